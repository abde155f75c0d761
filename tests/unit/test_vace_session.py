"""A VACE stream end to end on the CPU (tiny-vace, 64x64, one step): control sources, the live control scale,
host control frames refused when they do not fit, the depth source refused without its model, a reference."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from loom_live.engine.config import ConfigError, load_config
from loom_live.engine.models.loading import load_models
from loom_live.engine.stream import control_latents
from loom_live.engine.stream.control_latents import ControlEncoder, ZeroLatents
from tests.fakes.tiny_vace import SMALL, clip, session, tiny_vace_models


@pytest.fixture(scope="module")
def models():
    return tiny_vace_models()


def test_live_control_scale_switch_leaves_earlier_chunks_and_changes_later_ones(models):
    """Switched at a chunk boundary: the frames before equal the unswitched stream's, the rest differ."""
    frames = clip(13)
    steady, switched = session(models), session(models)
    a = [steady.push(frames[:5]), steady.push(frames[5:9]), steady.push(frames[9:])]
    b = [switched.push(frames[:5]), switched.push(frames[5:9])]
    switched.set_params(context_scale=0.0)
    b.append(switched.push(frames[9:]))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert np.abs(a[2].astype(int) - b[2].astype(int)).max() > 0
    assert switched.stats()["control"]["context_scale"] == 0.0
    with pytest.raises(ValueError, match="context_scale"):
        switched.set_params(context_scale=3.0)
    assert switched.stats()["control"]["context_scale"] == 0.0


def test_sources_steer_the_output(models):
    frames = clip(9)
    outs = {}
    for source in ("edges", "grey", "flow"):
        outs[source] = session(models, f"control.control_source={source}").push(frames)
        assert outs[source].shape == frames.shape
    assert not np.array_equal(outs["edges"], outs["grey"]) and not np.array_equal(outs["grey"], outs["flow"])


@pytest.mark.parametrize("between", ["video", "grey", "edges"])
def test_flow_switched_back_on_restarts_from_the_next_frame_whatever_source_came_between(between):
    """Switched away from flow and back, the first flow frame is still (no motion yet), as at a stream's
    start: after the video source it was the flow from the last frame before the switch, seconds old."""
    from loom_live.engine.stream.control_frames import ControlFrames

    x = torch.from_numpy(clip(12)).permute(0, 3, 1, 2).float() / 127.5 - 1
    frames = ControlFrames(torch.device("cpu"))
    frames.make("flow", x[:4])
    frames.make(between, x[4:8], given=x[4:8] if between == "video" else None)
    again = frames.make("flow", x[8:])
    assert torch.equal(again, ControlFrames(torch.device("cpu")).make("flow", x[8:]))
    assert (again[0] == -1).all()  # no speed: black


def test_host_control_frames_of_the_wrong_size_or_count_are_refused_and_counted(models):
    s = session(models, "control.control_source=video")
    frames = clip(9)
    out = s.push(frames[:5], control=np.zeros((5, 32, 32, 3), np.uint8))  # wrong size
    out = np.concatenate([out, s.push(frames[5:], control=np.zeros((3, 64, 64, 3), np.uint8))])  # 3 for 4
    assert len(out) == 9  # the stream went on
    assert s.stats()["control"]["refused_frames"] == 9
    given = session(models, "control.control_source=video")
    fitting = given.push(frames, control=255 - frames)
    assert given.stats()["control"]["refused_frames"] == 0
    assert not np.array_equal(fitting, out)  # the host's control frames were used, not the grey stand-in


def test_host_control_frames_holding_nan_are_refused_saying_so(models, caplog):
    """Float control frames with a NaN were refused as '4 control frames for 4 input frames; give one per
    input frame': the count was right, the values were not. The refusal names what was wrong."""
    s = session(models, "control.control_source=video")
    frames = clip(9)
    bad = np.full((9, 64, 64, 3), 0.5, np.float32)
    bad[2, 0, 0, 0] = np.nan
    with caplog.at_level("WARNING"):
        out = s.push(frames, control=bad)
    assert len(out) == 9 and s.stats()["control"]["refused_frames"] == 9  # the stream went on
    assert "1 of the 9 hold NaN or infinity" in caplog.text and "give one per input frame" not in caplog.text


def test_depth_source_without_its_model_is_refused_with_one_line(models, tmp_path):
    with pytest.raises(ConfigError, match="control.depth_model"):
        load_config("tiny-vace", [*SMALL, "control.control_source=depth"])
    with pytest.raises(ValueError, match=r"control.depth_model: .*not a directory") as info:
        session(models, "control.control_source=depth", f"control.depth_model={tmp_path / 'absent'}")
    assert "\n" not in str(info.value)
    s = session(models)
    with pytest.raises(ValueError, match="depth"):
        s.set_params(control_source="depth")
    assert s.stats()["control"]["source"] == "edges"
    with pytest.raises(ConfigError, match="needs a VACE model"):
        load_config("tiny-random", [f"control.reference={tmp_path / 'x.png'}"])


def test_reference_image_is_a_pinned_first_entry(models, tmp_path):
    ref = tmp_path / "ref.png"
    cv2.imwrite(str(ref), np.tile(np.linspace(0, 255, 64, dtype=np.uint8)[:, None, None], (1, 64, 3)))
    frames = clip(9)
    plain = session(models).push(frames)
    s = session(models, f"control.reference={ref}")
    out = s.push(frames)
    assert out.shape == frames.shape and not np.array_equal(out, plain)
    assert s.denoiser.cache.positions[0][0] == 0
    with pytest.raises(ValueError, match="cannot be read as an image"):
        session(models, f"control.reference={tmp_path / 'none.png'}")


def test_a_float16_vae_overflow_starts_a_new_stream_with_the_reference_pinned_again(tmp_path):
    """The restart after a float16 overflow scrubs the KV cache before the new stream commits its reference: the
    frames after it are a fresh session's, reference and all."""
    ref = tmp_path / "ref.png"
    cv2.imwrite(str(ref), np.tile(np.linspace(0, 255, 64, dtype=np.uint8)[:, None, None], (1, 64, 3)))
    over = ("vae.dtype=float16", "model.dtype=float32", f"control.reference={ref}")
    half = load_models(load_config("tiny-vace", [*SMALL, *over]))
    s = session(half, *over)
    first = s.push(clip(1))
    conv_in = half.encoder.encoder.conv_in.weight
    kept = conv_in.detach().clone()
    with torch.no_grad():
        conv_in.mul_(1e5)
    broken = s.push(clip(4))
    with torch.no_grad():
        conv_in.copy_(kept)
    frames = clip(9)
    out = np.concatenate([o for o in (broken, s.push(frames[:5]), s.push(frames[5:]), s.flush()) if len(o)])
    fresh = session(half, *over)
    expected = np.concatenate([o for o in (fresh.push(frames[:5]), fresh.push(frames[5:]), fresh.flush()) if len(o)])
    assert s.vae_restarts == 1 and len(first) + len(out) == 1 + 4 + 9  # one frame out for each in
    assert np.array_equal(out[-9:], expected)


def test_control_latents_are_the_grey_and_control_videos_encoded_beside_a_mask_of_ones(models):
    enc = ControlEncoder(models.encoder)
    grey_state, control_state = models.encoder.new_stream_state(), models.encoder.new_stream_state()
    torch.manual_seed(0)
    with torch.no_grad():
        for x in [torch.rand(5, 3, 64, 64) * 2 - 1, torch.rand(4, 3, 64, 64) * 2 - 1]:
            got = enc.latents(x)
            pixels = x.permute(1, 0, 2, 3)[None]
            grey = models.encoder.encode_stream(torch.zeros_like(pixels), grey_state)
            torch.testing.assert_close(got[:, :16], grey, rtol=1e-5, atol=1e-5)  # one latent at a time
            assert torch.equal(got[:, 16:32], models.encoder.encode_stream(pixels, control_state))
            assert got.shape[1] == 96 and bool((got[:, 32:] == 1).all())


def _grey_stream(encoder, chunks: list[int], size: int = 16) -> list[torch.Tensor]:
    """A zero video encoded live, chunk by chunk (frames per chunk), on a stream state of its own."""
    state = encoder.new_stream_state()
    return [encoder.encode_stream(torch.zeros(1, 3, n, size, size), state) for n in chunks]


@pytest.mark.parametrize("limit", [64, 3])
def test_the_grey_latents_are_encoded_once_and_equal_a_live_encode_in_every_stream(models, monkeypatch, limit):
    """Two streams of 30 latents in chunks of one to three latents: each chunk's grey latents equal a
    live encode of zeros; the tiny VAE's history reaches its fixed point (latent 20) and nothing is
    encoded after it, not even in the second stream. With a limit of 3 kept latents (no fixed point
    before it) the latents past it are encoded live, from the history kept at the limit."""
    monkeypatch.setattr(control_latents, "MEMO_LIMIT", limit)
    chunks = [1, 4, 8, 4, 12] + [4] * 10 + [8] * 6  # 30 latents
    grey = ZeroLatents(models.encoder)
    with torch.no_grad():
        want = torch.cat(_grey_stream(models.encoder, chunks), dim=2)
        for stream in range(2):
            grey.reset()
            got = torch.cat([grey.next(torch.empty(1, 3, n, 16, 16)) for n in chunks], dim=2)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            if stream == 0:
                first = grey.encodes
    if limit == 64:
        assert grey.steady_from is not None and grey.steady_from < 30
        assert grey.encodes == first == grey.steady_from + 1  # none after the fixed point, none in stream 2
    else:
        assert grey.steady_from is None and len(grey.kept) == 3
        assert grey.encodes == first + (30 - 3)  # past the limit each stream encodes its own


def test_a_new_size_gets_its_own_grey_latents(models):
    grey = ZeroLatents(models.encoder)
    with torch.no_grad():
        grey.next(torch.empty(1, 3, 5, 16, 16))
        grey.reset()
        got = grey.next(torch.empty(1, 3, 5, 24, 24))
        want = _grey_stream(models.encoder, [5], size=24)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_player_control_options_become_config_keys(tmp_path):
    from loom_live.engine.host_overrides import control_override

    assert control_override("flow", None) == ["control.control_source=flow"]
    cfg = load_config("tiny-vace", control_override(str(tmp_path / "c.mp4"), str(tmp_path / "r.png")))
    assert (cfg.control.control_source, cfg.control.video, cfg.control.reference) == (
        "video", str(tmp_path / "c.mp4"), str(tmp_path / "r.png"))


def test_a_control_video_that_is_not_there_is_said_to_be_missing_not_unopenable(tmp_path):
    """A config's control.video that does not exist was said to be a file that "cannot be opened as a video"."""
    from loom_live.engine.stream.control_frames import ControlVideoFile

    with pytest.raises(ValueError, match=r"^control\.video: .*nosuch\.mp4: no such file$"):
        ControlVideoFile(str(tmp_path / "nosuch.mp4"))
    (tmp_path / "notes.mp4").write_text("not a video")
    with pytest.raises(ValueError, match=r"notes\.mp4 cannot be opened as a video$"):
        ControlVideoFile(str(tmp_path / "notes.mp4"))


@pytest.mark.parametrize("source", ["edges", "video"])
def test_the_control_video_encoded_in_the_inputs_vae_call_gives_the_same_stream(models, monkeypatch, source):
    """control.batched_encode: the control video as the second stream of the input's VAE call. Both
    encodes keep their own causal history in the batch, so each chunk's output and control latents are
    those of two separate calls (up to float rounding), over the first chunk and the steady ones."""
    frames = clip(17)
    given = {"control": 255 - frames} if source == "video" else {}
    encode_stream = models.encoder.encode_stream
    runs = {}
    for batched in (False, True):
        s = session(models, f"control.control_source={source}", f"control.batched_encode={batched}")
        latents, batches = [], []
        assemble = s.control.encoder.assemble
        monkeypatch.setattr(s.control.encoder, "assemble",
                            lambda reactive, pixels, f=assemble, seen=latents:
                            seen.append(f(reactive, pixels)) or seen[-1])
        monkeypatch.setattr(models.encoder, "encode_stream",
                            lambda x, state, seen=batches: seen.append(x.shape[0]) or encode_stream(x, state))
        out = [s.push(frames[i:i + n], **{k: v[i:i + n] for k, v in given.items()})
               for i, n in ((0, 5), (5, 4), (9, 8))]
        runs[batched] = np.concatenate(out), latents, batches.count(2)
        monkeypatch.undo()
    (plain, plain_latents, plain_pairs), (joint, joint_latents, joint_pairs) = runs[False], runs[True]
    # one call per VAE step carries both videos: the first chunk's first frame and its steady step, then one
    # per latent (the 8-frame chunk: two)
    assert plain_pairs == 0 and joint_pairs == 5
    assert len(joint_latents) == len(plain_latents) == 4  # chunks of one latent: 5, 4, then 4 + 4 frames
    for a, b in zip(plain_latents, joint_latents):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert np.abs(joint.astype(int) - plain.astype(int)).max() <= 1
