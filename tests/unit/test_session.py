"""StreamSession end to end on the CPU with the embedded tiny models."""

from __future__ import annotations

import gc
import os
import resource

import numpy as np
import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.stream.session import StreamSession
from loom_live.engine.stream.slo_scheduler import Plan
from tests.fakes.media import panning_clip

SMALL = ["resolution.width=64", "resolution.height=64"]


def session(*overrides: str) -> StreamSession:
    return StreamSession.from_config(load_config("tiny-random", [*SMALL, *overrides]))


def clip(n: int, h: int = 64, w: int = 64, seed: int = 0) -> np.ndarray:
    return panning_clip(n, h, w, seed)


def run_all(s: StreamSession, frames: np.ndarray, step: int) -> np.ndarray:
    outs = [s.push(frames[i:i + step]) for i in range(0, len(frames), step)]
    outs.append(s.flush())
    return np.concatenate([o for o in outs if len(o)])


def test_81_frames_in_81_out_same_size():
    frames = clip(81, 32, 32)
    out = run_all(session("resolution.width=32", "resolution.height=32"), frames, 81)
    assert out.shape == frames.shape and out.dtype == np.uint8


def test_output_is_deterministic_for_a_seed():
    tiny = ("resolution.width=32", "resolution.height=32")
    frames = clip(21, 32, 32)
    a = run_all(session(*tiny), frames, 21)
    assert np.array_equal(a, run_all(session(*tiny), frames, 21))
    assert not np.array_equal(a, run_all(session(*tiny, "stream.seed=1"), frames, 21))


def test_one_frame_pushes_give_the_same_frames_as_one_big_push():
    frames = clip(29)
    whole = run_all(session("stream.mode=batch"), frames, 29)
    single = run_all(session("stream.mode=batch"), frames, 1)
    assert np.array_equal(whole, single)


def test_a_float16_vae_under_a_float32_model_restyles_as_the_float32_one():
    """The VAE in its own dtype (`vae.dtype`): latents cross to the model's dtype at its edges, and the
    frames differ from the all-float32 run by float16 rounding only."""
    frames, small = clip(13, 32, 32), ("resolution.width=32", "resolution.height=32")
    ref = run_all(session("model.dtype=float32", *small), frames, 13)
    s = session("model.dtype=float32", "vae.dtype=float16", *small)
    assert s.models.encoder.dtype == torch.float16 and s.models.dtype == torch.float32
    out = run_all(s, frames, 13)
    assert out.shape == ref.shape
    diff = np.abs(out.astype(int) - ref.astype(int))
    assert diff.max() <= 2 and diff.mean() < 0.3  # a bfloat16 VAE here: max 4, mean 0.57


def test_a_float16_vae_that_overflows_is_counted_and_said_once(caplog):
    """Values past float16's range break the stream's frames for good: the session counts the chunks that
    came out non-finite (read without waiting for the GPU) and logs once what to set instead."""
    s = session("model.dtype=float32", "vae.dtype=float16", "resolution.width=32", "resolution.height=32")
    run_all(s, clip(9, 32, 32), 9)
    assert s.stats()["vae_nonfinite_chunks"] == 0
    with torch.no_grad():
        s.models.decoder.decoder.conv_in.weight.mul_(1e5)  # its outputs past 65504: inf, then NaN in the norms
    with caplog.at_level("ERROR"):
        run_all(s, clip(9, 32, 32), 9)
        assert s.stats()["vae_nonfinite_chunks"] >= 1
        s.stats()
    said = [r.getMessage() for r in caplog.records if "outgrew float16" in r.getMessage()]
    assert len(said) == 1 and "vae.dtype=bfloat16" in said[0]
    assert "vae_nonfinite_chunks" not in session("model.dtype=float32").stats()  # a float32 VAE: no watch


def test_a_float16_vae_that_overflowed_once_starts_a_new_stream_and_its_frames_come_back():
    """One picture past float16's range leaves NaN in the VAE's history and, through the latents, in the KV cache:
    without a new stream every later frame would stay broken. The session flushes (one frame out for each in),
    scrubs the KV cache and starts afresh, as a new session would."""
    args = ("model.dtype=float32", "vae.dtype=float16", "stream.mode=batch", "resolution.width=32",
            "resolution.height=32")
    s = session(*args)
    conv_in = s.models.encoder.encoder.conv_in.weight
    kept = conv_in.detach().clone()
    run_all(s, clip(9, 32, 32), 9)
    with torch.no_grad():
        conv_in.mul_(1e5)  # one push's chunks overflow: inf, then NaN in the norms and the histories
    broken = s.push(clip(8, 32, 32, seed=1))
    with torch.no_grad():
        conv_in.copy_(kept)
    assert s.stats()["vae_nonfinite_chunks"] >= 1 and s.vae_restarts == 0
    later = clip(17, 32, 32, seed=2)
    outs = [broken] + [s.push(later[i:i + 4]) for i in range(0, 17, 4)] + [s.flush()]
    assert s.vae_restarts == 1 and s.stats()["vae_restarts"] == 1
    out = np.concatenate([o for o in outs if len(o)])
    assert len(out) == 8 + 17  # every frame pushed since the overflow came out
    assert np.array_equal(out[8:], run_all(session(*args), later, 4))  # the new stream is a fresh one


def test_vae_dtype_is_refused_where_no_wan_vae_runs():
    with pytest.raises(ValueError, match="vae.dtype: float16 is the Wan VAE's"):
        load_config("tiny-random", ["vae.dtype=float16", "vae.encoder=taehv", "vae.decoder=taehv",
                                    "vae.random_weights=true"])


def test_outputs_come_back_in_input_order():
    # crop policy with a wider input: the side bands pass through unchanged, so they carry
    # each input frame's identity to its output.
    frames = clip(23, h=64, w=96)
    for i in range(len(frames)):
        frames[i, :, :8] = i * 10
    out = run_all(session("resolution.resize=crop"), frames, 3)
    assert out.shape == frames.shape
    assert [int(o[0, 0, 0]) for o in out] == [i * 10 for i in range(23)]


@pytest.mark.parametrize("size", [(37, 53), (120, 50)])
def test_odd_input_sizes(size):
    frames = clip(9, *size)
    for policy in ("crop", "fit", "stretch"):
        out = run_all(session(f"resolution.resize={policy}"), frames, 2)
        assert out.shape == frames.shape


def test_sequential_and_batch_modes_and_switching_keep_the_stream():
    frames = clip(45)
    s = session("stream.steps=[700,500,300]", "stream.mode=batch")
    outs = [s.push(frames[:21])]
    assert s.stats()["plan"]["mode"] == "batch"
    s.set_params(mode="sequential")
    outs.append(s.push(frames[21:33]))
    s.set_params(mode="batch", steps=[700, 400])
    outs.append(s.push(frames[33:]))
    outs.append(s.flush())
    out = np.concatenate([o for o in outs if len(o)])
    assert out.shape == frames.shape


def test_bad_input_is_refused_or_dropped_and_the_stream_goes_on():
    s = session()
    with pytest.raises(ValueError, match="dtype int32"):
        s.push(np.zeros((2, 64, 64, 3), np.int32))
    with pytest.raises(ValueError, match=r"\[N, H, W, 3\]"):
        s.push(np.zeros((2, 64, 64, 4), np.uint8))
    with pytest.raises(ValueError, match="zero size"):
        s.push(np.zeros((2, 0, 64, 3), np.uint8))
    with pytest.raises(ValueError, match="empty"):
        s.set_prompt("  ")
    with pytest.raises(ValueError, match="unknown parameter 'stepz'"):
        s.set_params(stepz=[700])
    with pytest.raises(ValueError, match="noise_scale"):
        s.set_params(noise_scale=7.0)
    good = clip(9).astype(np.float32) / 255.0
    good[3, 5, 5, 1] = np.nan
    good[6, 0, 0, 0] = np.inf
    out = [s.push(good)]
    out.append(s.flush())
    assert sum(len(o) for o in out) == 7
    assert s.stats()["dropped"] == 2


def test_prompt_switch_blends_without_resetting_positions():
    s = session("prompt.transition_chunks=3", "prompt.blend=linear")
    frames = clip(41)
    s.push(frames[:13])
    before = s.stats()["kv_positions"]
    s.set_prompt("charcoal sketch")
    s.prompt.wait_pending(30)
    weights = []
    for i in range(4):
        s.push(frames[13 + 4 * i:17 + 4 * i])
        weights.append(s.stats()["prompt_blend"])
    after = s.stats()["kv_positions"]
    assert weights == pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    assert min(after) > max(before)  # positions kept counting, no reset
    assert s.stats()["prompt"] == "charcoal sketch"


def test_a_reset_starts_on_the_newest_prompt_with_no_blend_carried_over():
    """A host that starts a new stream (ComfyUI's next queue run) gets what a fresh session on that prompt
    gives, whatever prompt and blend the stream before it had, even with the encode still under way."""
    frames = clip(9, 32, 32)
    tiny = ("resolution.width=32", "resolution.height=32", "prompt.transition_chunks=4")
    fresh = session(*tiny, "prompt.text=charcoal sketch")
    expected = run_all(fresh, frames, 9)
    s = session(*tiny)
    run_all(s, clip(9, 32, 32, seed=1), 9)
    s.set_prompt("charcoal sketch")  # would blend in over 4 chunks; the reset jumps to it
    s.reset()
    assert s.stats()["prompt_blend"] == 1.0 and s.stats()["prompt"] == "charcoal sketch"
    assert np.array_equal(run_all(s, frames, 9), expected)


def test_stats_report_what_a_performer_needs():
    s = session()
    run_all(s, clip(21), 4)
    st = s.stats()
    for key in ("frames_in", "frames_out", "dropped", "fps", "ttff_s", "latency_ms", "latency_jitter_ms",
                "slo_miss_rate", "stages_ms", "plan", "noise_scale"):
        assert key in st
    assert st["frames_in"] == st["frames_out"] == 21
    assert {"encode", "dit", "decode"} <= set(st["stages_ms"])


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _live_objects() -> tuple[int, int]:
    """Live tensors and all objects the collector tracks: what a per-chunk leak would grow."""
    gc.collect()
    objects = gc.get_objects()
    return sum(isinstance(o, torch.Tensor) for o in objects), len(objects)


@pytest.mark.slow
def test_a_long_stream_keeps_memory_flat_and_positions_bounded():
    """Past the first RoPE refreshes every chunk leaves the same objects alive: a stream that held on to a
    tensor, or to any object the collector tracks (a list, a dict of objects, a record), per chunk would
    grow the counts; the bounded windows (latencies, arrivals) hold numbers only."""
    s = session("resolution.width=16", "resolution.height=16", "stream.steps=[700]")
    frame = clip(4, 16, 16)
    s.push(clip(5, 16, 16))
    cache_bytes = s.stats()["kv_cache_bytes"]
    highest = produced = 0
    for i in range(250):  # about five RoPE refreshes
        produced += len(s.push(frame))
        highest = max(highest, max(s.denoiser.cache.next_positions))
        if i == 60:
            tensors, objects, rss = *_live_objects(), _rss_mb()
    now_tensors, now_objects = _live_objects()
    assert now_tensors == tensors
    assert now_objects - objects < 50  # over 190 chunks: not one object a chunk
    assert _rss_mb() - rss < 10
    assert produced + len(s.flush()) == 1000
    assert s.stats()["kv_cache_bytes"] == cache_bytes
    assert highest <= 50  # RoPE refresh keeps positions inside the trained range (1000 frames pushed)


def test_tensor_frames_stay_tensors_and_match_the_numpy_path():
    """The cuda-ipc server hands device tensors; the session keeps them off the CPU. On a CPU the
    same path runs with CPU tensors and must give exactly the numpy path's frames."""
    import torch

    frames = clip(13, 48, 64)
    ref = run_all(session("resolution.resize=crop"), frames, 13)
    s = session("resolution.resize=crop")
    got = [s.push(torch.from_numpy(frames[:7])), s.push(torch.from_numpy(frames[7:])), s.flush()]
    tensors = [g for g in got if isinstance(g, torch.Tensor)]
    assert tensors and all(g.dtype == torch.uint8 for g in tensors)
    assert np.array_equal(torch.cat(tensors).numpy(), ref)
    assert s.accepts_device_frames is False  # on a CPU the server keeps using numpy frames


def test_live_sink_threshold_change_reaches_the_cache():
    s = session()
    produced = len(s.push(clip(9)))
    s.set_params(sink_threshold=-1.0)
    assert s.denoiser.cache.sink_threshold == -1.0
    produced += len(s.push(clip(4))) + len(s.flush())
    assert produced == 13


@pytest.mark.parametrize("overrides", [("stream.mode=batch",), ("stream.mode=sequential", "noise.estimator=farneback")])
def test_input_size_may_change_mid_chunk_and_the_stream_goes_on(overrides):
    """A host that changes its resolution on stage (between any two frames, here mid-chunk): no
    error and no new stream; each output has its own input's size, and they come in order (the
    crop policy passes the side bands through, carrying each frame's index)."""
    sizes = [(64, 96)] * 7 + [(48, 80)] * 6 + [(64, 80)] * 9 + [(48, 80)] * 3
    frames = [clip(1, h, w, seed=i)[0] for i, (h, w) in enumerate(sizes)]
    for i, f in enumerate(frames):
        f[:, :4] = i * 10
    s = session("resolution.resize=crop", *overrides)
    out, positions = [], []
    for f in frames:
        out += list(s.push(f))
        positions.append(max(s.denoiser.cache.next_positions))
    out += list(s.flush())
    assert [o.shape for o in out] == [f.shape for f in frames]
    assert [int(o[0, 0, 0]) for o in out] == [i * 10 for i in range(len(frames))]
    assert positions == sorted(positions) and positions[-1] > positions[7]  # one stream: positions go on
    assert s.stats()["frames_out"] == len(frames) and s.stats()["dropped"] == 0


def test_a_size_change_after_a_push_of_several_chunks_at_a_new_size_keeps_the_stream():
    """A push of several chunks' worth at a new size leaves them all in the buffer (no result mixes two
    sizes); the next size change cuts them into whole chunks before padding the rest. Padded whole, they
    made one chunk of 6 latent frames, which overran the KV ring: a ValueError from every later call."""
    s = session("stream.mode=batch")
    sizes = [9, 24, 1, 4]
    shapes = [(64, 64), (48, 48), (32, 32), (32, 32)]
    out = [s.push(clip(n, h, w, seed=i)) for i, (n, (h, w)) in enumerate(zip(sizes, shapes))]
    out.append(s.flush())
    assert [o.shape[1:3] for o in out if len(o)] == [(64, 64), (64, 64), (48, 48), (32, 32)]
    assert sum(len(o) for o in out) == sum(sizes)
    assert s.stats()["frames_out"] == sum(sizes)


def test_a_bad_prompt_request_or_huge_parameter_is_refused_and_the_stream_goes_on():
    """In-process callers get what the wire refuses as a ValueError naming it: a NaN blend length (it
    blackened every later frame for good) and a float parameter of 400 digits (an OverflowError)."""
    tiny = ("resolution.width=32", "resolution.height=32")
    s = session(*tiny)
    out = [s.push(clip(9, 32, 32))]
    with pytest.raises(ValueError, match="transition_chunks: 'nan' is not allowed"):
        s.set_prompt("charcoal sketch", float("nan"))
    with pytest.raises(ValueError, match="noise.noise_scale: 9+...9+ is not allowed; expected a finite number"):
        s.set_params(noise_scale=int("9" * 400))
    s.set_prompt("charcoal sketch", 2)
    s.prompt.wait_pending(10)
    out += [s.push(clip(4, 32, 32, seed=i)) for i in range(3)]
    out.append(s.flush())
    frames = np.concatenate([o for o in out if len(o)])
    assert len(frames) == 21 and frames.std() > 1.0  # restyled frames, not a black stream
    assert s.stats()["prompt"] == "charcoal sketch" and s.stats()["prompt_blend"] == 1.0


def test_pinning_a_mode_live_streams_its_one_plan_not_the_chunk_size_auto_had_picked():
    """The scheduler moves only in auto: a mode pinned mid-stream kept the chunk size auto had picked
    under a load spike (3 latents, 12-frame chunks) for the rest of the stream, three times the latency
    of the same mode pinned from the start."""
    tiny = ("resolution.width=32", "resolution.height=32")
    s = session(*tiny)
    out = [s.push(clip(9, 32, 32))]
    s.slo.hold(Plan("sequential", 3))  # what auto chose
    out.append(s.push(clip(12, 32, 32, seed=1)))
    s.set_params(mode="sequential")
    out += [s.push(clip(4, 32, 32, seed=i)) for i in range(3)]
    assert s.stats()["plan"] == {"mode": "sequential", "chunk_latents": 1}
    assert [len(o) for o in out] == [5, 4 + 12, 4, 4, 4]  # one chunk a push, each pushed frame once
