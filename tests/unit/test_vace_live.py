"""Live VACE input on the CPU (tiny-vace, 64x64, one step): a reference image changed mid-stream takes
effect at the next chunk, in place of the pinned first entry; frames of the video source without a
control frame are counted; a model without control blocks counts host control frames and goes on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.models.loading import load_models
from loom_live.engine.stream.session import StreamSession
from tests.fakes.tiny_vace import SMALL, clip, session, tiny_vace_models


@pytest.fixture(scope="module")
def models():
    return tiny_vace_models()


def gradient(vertical: bool) -> np.ndarray:
    ramp = np.linspace(0, 255, 64, dtype=np.uint8)
    return np.ascontiguousarray(np.broadcast_to((ramp[:, None] if vertical else ramp[None, :])[..., None],
                                                (64, 64, 3)))


def slot0(s: StreamSession) -> list[torch.Tensor]:
    cache = s.denoiser.cache
    return [torch.cat([cache.k[i][:, 0], cache.v[i][:, 0]]) for i in sorted(cache.k)]


def test_a_new_reference_mid_stream_replaces_the_pinned_entry_at_the_next_chunk(models):
    """Before the change the stream is the unchanged one's; after it the first slot holds what a stream
    started with the new reference holds there, and the output differs from the unchanged stream's."""
    frames, first, second = clip(9), gradient(vertical=True), gradient(vertical=False)
    steady, changed = session(models), session(models)
    for s in (steady, changed):
        s.set_reference(first)
    a = [steady.push(frames[:5]), steady.push(frames[5:])]
    b = [changed.push(frames[:5])]
    changed.set_reference(second)
    b.append(changed.push(frames[5:]))
    assert np.array_equal(a[0], b[0])
    assert np.abs(a[1].astype(int) - b[1].astype(int)).max() > 0
    fresh = session(models)
    fresh.set_reference(second)
    fresh.push(frames[:5])
    for got, want in zip(slot0(changed), slot0(fresh)):
        assert torch.equal(got, want)
    assert changed.stats()["control"]["reference"] == "a host's image (64x64)"
    assert changed.denoiser.cache.positions[0][0] == 0


def test_a_reference_added_to_a_stream_without_one_and_cleared_again(models):
    frames = clip(13)
    s = session(models)
    out = [s.push(frames[:5])]
    s.set_reference(gradient(vertical=True))
    out.append(s.push(frames[5:9]))
    assert s.denoiser.cache._rows[0].pinned == 1
    fresh = session(models)
    fresh.set_reference(gradient(vertical=True))
    fresh.push(frames[:5])
    assert all(torch.equal(got, want) for got, want in zip(slot0(s), slot0(fresh)))
    s.set_reference(None)
    out.append(s.push(frames[9:]))
    assert len(np.concatenate(out)) == 13 and s.denoiser.cache._rows[0].pinned == 0
    assert s.stats()["control"]["reference"] is None


def test_a_bad_reference_is_refused_in_one_line_and_the_old_one_stays(models):
    s = session(models)
    s.set_reference(gradient(vertical=True))
    for bad, words in [(np.zeros((64, 64), np.uint8), "reference image"),
                       (np.zeros((2, 8, 8, 3), np.uint8), "expected one uint8 RGB image")]:
        with pytest.raises(ValueError, match=words) as refused:
            s.set_reference(bad)
        assert "\n" not in str(refused.value)
    assert s.stats()["control"]["reference"] == "a host's image (64x64)"


def test_video_source_frames_without_control_are_counted_as_missing(models):
    s = session(models, "control.control_source=video")
    frames = clip(9)
    out = np.concatenate([s.push(frames[:5], control=255 - frames[:5]), s.push(frames[5:])])
    assert len(out) == 9
    control = s.stats()["control"]
    assert (control["missing_frames"], control["refused_frames"]) == (4, 0)


def test_a_model_without_control_blocks_counts_control_frames_and_refuses_a_reference():
    cfg = load_config("tiny-random", SMALL)
    s = StreamSession(cfg, load_models(cfg))
    frames = clip(5)
    assert s.push(frames, control=frames).shape == frames.shape  # the frames go on
    assert s.no_control.refused_frames == 5
    with pytest.raises(ValueError, match="no VACE control blocks"):
        s.set_reference(gradient(vertical=True))


def test_a_reference_for_a_stream_without_sinks_is_refused_and_the_stream_goes_on(models):
    """The reference is pinned as the first sink: with stream.sink=0 there is none, as control.reference is
    refused at load. Taken live, it failed the next chunk (its frames lost) and every new stream after it."""
    s = session(models, "stream.sink=0")
    frames = clip(13)
    out = [s.push(frames[:5])]
    with pytest.raises(ValueError, match=r"reference image: .*stream\.sink=0.*stream\.sink >= 1") as refused:
        s.set_reference(gradient(vertical=True))
    assert "\n" not in str(refused.value)
    s.set_reference(None)  # none is always allowed
    out += [s.push(frames[5:9]), s.push(frames[9:]), s.flush()]
    assert sum(len(o) for o in out) == 13
    assert s.stats()["control"]["reference"] is None
    assert len(s.push(frames[:5])) + len(s.flush()) == 5  # a new stream starts as before
