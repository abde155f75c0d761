"""The session's building blocks: flow schedule, motion-aware noise, prompts, metrics."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

from loom_live.engine.stream.metrics import StreamMetrics
from loom_live.engine.stream.motion_noise import MotionNoiseController, OpticalFlowMotion, frame_difference_motion
from loom_live.engine.stream.prompts import FileTextEncoder, HashTextEncoder, PromptConditioner, PromptError, blend
from loom_live.engine.stream.schedule import FlowSchedule
from tests.fakes.disk import fill_the_disk


def test_flow_schedule_shift_and_round_trip():
    fs = FlowSchedule(shift=8.0)
    assert fs.sigma(0) == 0.0
    assert fs.sigma(700) == pytest.approx(8 * 0.7 / (1 + 7 * 0.7))
    assert fs.model_timestep(500) == pytest.approx(1000 * 8 * 0.5 / (1 + 7 * 0.5))
    x0, eps = torch.randn(2, 4, 1, 3, 3), torch.randn(2, 4, 1, 3, 3)
    sigma = torch.tensor([0.9, 0.3])
    xt = fs.add_noise(x0, eps, sigma)
    assert torch.allclose(fs.to_x0(xt, eps - x0, sigma), x0, atol=1e-6)
    with pytest.raises(ValueError, match="outside"):
        fs.sigma(1000)


def _frames(t: int, motion: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    base = torch.rand(1, 3, 32, 32, generator=g) * 2 - 1
    return torch.cat([torch.roll(base, shifts=int(i * motion), dims=3) for i in range(t)])


def test_motion_formula_static_scene_keeps_s_init():
    ctl = MotionNoiseController(noise_scale=0.8, ema=0.9)
    static = _frames(4, 0)
    for _ in range(10):
        s = ctl.update(static, static[-1])
    assert float(s) == pytest.approx(0.8)
    assert float(ctl.first_step(s)) == pytest.approx(700.0)


def test_motion_formula_large_motion_lowers_noise_with_ema():
    moving = _frames(5, 6)
    d = float(frame_difference_motion(moving, None))
    assert d == pytest.approx(1.0)  # random texture shifted by 6 px: RMS difference far above 0.2
    ctl = MotionNoiseController(noise_scale=0.8, ema=0.9)
    s1 = float(ctl.update(moving, None))
    assert s1 == pytest.approx((0.8 - 0.1 * 1.0) * 0.9 + 0.8 * 0.1)
    s2 = float(ctl.update(moving, moving[-1]))
    assert s2 == pytest.approx((0.8 - 0.1) * 0.9 + s1 * 0.1)
    assert float(ctl.first_step(s2)) < 700


def test_motion_disabled_is_constant():
    ctl = MotionNoiseController(noise_scale=0.6, enabled=False)
    assert ctl.update(_frames(4, 6), None) == 0.6


def test_motion_switched_off_live_says_the_plain_scale_in_the_stats():
    """On CUDA the stats read a pinned copy of the motion-aware values; switched off, that copy must not stay
    on show (the noise scale in the stats stopped following its slider)."""
    ctl = MotionNoiseController(noise_scale=0.8, ema=0.9)
    ctl.advance(0.5)
    ctl._telemetry = torch.tensor([0.45, 0.5])  # what a CUDA chunk leaves for the stats
    ctl.set_noise(0.6, enabled=False)
    ctl.update(_frames(4, 6), None)
    assert ctl.telemetry() == (0.6, 0.0)


@pytest.mark.parametrize("method", ["dis", "farneback"])
def test_optical_flow_estimator_runs_off_thread(method):
    flow = OpticalFlowMotion(method)
    rng = np.random.default_rng(0)
    base = (rng.random((64, 96, 3)) * 255).astype(np.uint8)
    base = np.kron(base[::8, ::8], np.ones((8, 8, 1), np.uint8))[:64, :96]
    still = np.stack([base] * 4)
    flow.submit(still, None)
    flow._pending.result(10)
    assert flow.latest() == pytest.approx(0.0, abs=0.05)
    moving = np.stack([np.roll(base, 6 * i, axis=1) for i in range(4)])
    flow.submit(moving, None)
    flow._pending.result(10)
    assert flow.latest() > 0.2
    flow.close()


def test_hash_encoder_is_deterministic_and_distinguishes_prompts():
    enc = HashTextEncoder(32)
    a, b = enc.encode(["neon city"]), enc.encode(["neon city"])
    c = enc.encode(["oil painting"])
    assert a.shape == (1, 512, 32) and torch.equal(a, b) and not torch.equal(a, c)
    assert a[0, 2:].abs().sum() == 0  # padding is zero, as Wan pads umT5 output
    with pytest.raises(PromptError, match="empty"):
        enc.encode(["   "])


def test_prompt_change_blends_over_transition_chunks():
    enc = HashTextEncoder(16)
    cond = PromptConditioner(enc, "a cat", device=torch.device("cpu"), dtype=torch.float32,
                             transition_chunks=4, blend_mode="linear")
    old = cond.current().clone()
    _, changed = cond.advance()
    assert not changed
    cond.request("a dog")
    cond.wait_pending(10)
    new = enc.encode(["a dog"])[0]
    weights = []
    for _ in range(5):
        emb, changed = cond.advance()
        weights.append(cond.weight)
        if cond.weight < 1:
            assert torch.allclose(emb, torch.lerp(old, new, cond.weight), atol=1e-6)
    assert weights == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert torch.allclose(cond.current(), new)
    cond.close()


def test_prompt_requests_faster_than_encoding_do_not_queue_up():
    """A prompt typed live (a request per keystroke) or swept over OSC: only the newest is encoded
    next, so it arrives after at most two encodes, not after every stale one."""
    class SlowEncoder(HashTextEncoder):
        calls = 0

        def encode(self, texts):
            SlowEncoder.calls += 1
            time.sleep(0.05)
            return super().encode(texts)

    cond = PromptConditioner(SlowEncoder(8), "a", device=torch.device("cpu"), dtype=torch.float32,
                             transition_chunks=0)
    for i in range(40):
        cond.request(f"word{i}")
    cond.wait_pending(10)
    cond.advance()
    assert cond.text == "word39"
    assert SlowEncoder.calls <= 3  # the first prompt, at most one already running, the newest
    cond.close()


def test_a_prompt_that_cannot_be_encoded_never_breaks_the_stream(tmp_path):
    """Unknown to a prompt file: refused at the request, with what the file holds. Failing in the
    background encoder: the stream keeps its prompt and says why (before, the error came out of
    the next push, in the middle of a chunk)."""
    from loom_live.plugin.cli.encode_prompts import write_embeddings

    path = tmp_path / "p.safetensors"
    write_embeddings(HashTextEncoder(8), ["neon city", "ink wash"], path)
    cond = PromptConditioner(FileTextEncoder(path), "neon city", device=torch.device("cpu"),
                             dtype=torch.float32, transition_chunks=0)
    with pytest.raises(PromptError, match="no embedding for prompt 'watercolour'.*ink wash"):
        cond.request("watercolour")
    assert not cond.pending and cond.text == "neon city"
    cond.close()

    class FlakyEncoder(HashTextEncoder):
        def encode(self, texts):
            if texts == ["fails"]:
                raise RuntimeError("CUDA out of memory (simulated)")
            return super().encode(texts)

    cond = PromptConditioner(FlakyEncoder(8), "a cat", device=torch.device("cpu"), dtype=torch.float32,
                             transition_chunks=0)
    before = cond.current().clone()
    cond.request("fails")
    cond.wait_pending(10)
    emb, changed = cond.advance()
    assert not changed and torch.equal(emb, before) and cond.text == "a cat"
    assert "prompt 'fails' could not be encoded: RuntimeError: CUDA out of memory" in cond.error
    cond.request("a dog")
    cond.wait_pending(10)
    _, changed = cond.advance()
    assert changed and cond.text == "a dog" and cond.error is None
    cond.close()


def test_slerp_keeps_norm_between_unit_vectors():
    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    mid = blend(a, b, 0.5, "slerp")
    assert mid.norm().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(blend(a, b, 0.0, "slerp"), a) and torch.equal(blend(a, b, 1.0, "slerp"), b)


def test_embeddings_file_round_trip_and_unknown_prompt(tmp_path):
    from loom_live.plugin.cli.encode_prompts import write_embeddings

    out = tmp_path / "p.safetensors"
    write_embeddings(HashTextEncoder(8), ["neon city", "ink wash"], out)
    enc = FileTextEncoder(out)
    assert torch.equal(enc.encode(["ink wash"]), HashTextEncoder(8).encode(["ink wash"]))
    with pytest.raises(PromptError, match="no embedding for prompt 'watercolour'"):
        enc.encode(["watercolour"])


def test_a_prompt_path_of_the_other_kind_is_said_as_a_file_or_a_folder(tmp_path):
    """An embeddings file given to prompt.encoder=umt5 was said as "umT5 directory not found", and a umT5
    folder given to prompt.encoder=file as "file not found": both there, just the other kind."""
    from loom_live.engine.config import load_config
    from loom_live.engine.models.loading import check_weight_files
    from loom_live.plugin.cli.encode_prompts import write_embeddings

    embeddings, folder = tmp_path / "p.safetensors", tmp_path / "umt5"
    write_embeddings(HashTextEncoder(8), ["neon city"], embeddings)
    folder.mkdir()
    said = re.escape(f"{embeddings}: is a file; prompt.encoder=umt5 reads a umT5 folder")
    with pytest.raises(PromptError, match=f"^{said}"):
        check_weight_files(load_config("tiny-random", ["prompt.encoder=umt5", f"prompt.path={embeddings}"]))
    said = re.escape(f"{folder}: is a folder; prompt.encoder=file reads one .safetensors file")
    with pytest.raises(PromptError, match=f"^{said}"):
        check_weight_files(load_config("tiny-random", ["prompt.encoder=file", f"prompt.path={folder}"]))


def test_an_embeddings_file_the_disk_cannot_hold_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    """`loom encode-prompts -y` over a show's embeddings: a full disk midway leaves the file it had, readable."""
    from loom_live.plugin.cli.encode_prompts import write_embeddings

    out = tmp_path / "p.safetensors"
    write_embeddings(HashTextEncoder(8), ["neon city"], out)
    earlier = out.read_bytes()
    fill_the_disk(monkeypatch)
    with pytest.raises(OSError, match="No space left on device") as full:
        write_embeddings(HashTextEncoder(8), ["neon city", "ink wash"], out)
    assert full.value.filename == str(out) and out.read_bytes() == earlier
    assert [p.name for p in tmp_path.iterdir()] == ["p.safetensors"]
    assert torch.equal(FileTextEncoder(out).encode(["neon city"]), HashTextEncoder(8).encode(["neon city"]))


def test_metrics_restarted_mid_stream_pair_each_output_with_its_own_frames():
    """A stream-batch pipeline holds a chunk when a bench restarts the figures after its warm-up: that chunk's
    output must pair with its own push time, not with the chunk pushed after the restart."""
    m = StreamMetrics(latency_budget_s=10.0)
    m.on_input(4, t=0.0)  # in the pipeline's second row at the restart
    m.on_input(4, t=1.0)
    m.on_output(4, t=1.5)  # the chunk before leaves (its frames pushed at 0)
    m.restart()  # the figures afresh, the first frame's time too (a pipeline's warm-up restarts them)
    assert m.snapshot()["frames_out"] == 0 and m.snapshot()["latency_ms"]["mean"] is None
    assert m.snapshot()["ttff_s"] is None
    m.on_input(4, t=2.0)
    m.on_output(4, t=2.5)  # the chunk pushed at 1.0 leaves
    assert m.snapshot()["latency_ms"]["p50"] == pytest.approx(1500.0)
    m.reset()  # a new stream: what was in flight was dropped with it
    m.on_input(4, t=3.0)
    m.on_output(4, t=3.25)
    assert m.snapshot()["latency_ms"]["p50"] == pytest.approx(250.0)


def test_metrics_latency_percentiles_and_misses():
    clock = iter(range(1000)).__next__
    m = StreamMetrics(latency_budget_s=2.5, clock=lambda: float(clock()))
    m.on_input(4, t=0.0)
    m.on_output(4, t=2.0)
    m.on_input(4, t=4.0)
    m.on_output(4, t=7.0)
    m.on_drop(1, "nan")
    snap = m.snapshot()
    assert snap["frames_in"] == 8 and snap["frames_out"] == 8 and snap["dropped"] == 1
    assert snap["ttff_s"] == 2.0
    assert snap["latency_ms"]["p50"] == pytest.approx(2500.0)
    assert snap["slo_miss_rate"] == 0.5
    assert snap["dropped_reasons"] == {"nan": 1}


@pytest.mark.parametrize("chunks", [float("nan"), 2.5, "3", -1, 1001, True])
def test_a_prompt_change_refuses_a_blend_length_that_is_not_a_whole_number_of_chunks(chunks):
    """A NaN blend length made the blend weight NaN: the conditioning, the KV cache and so every later
    frame went black, a new prompt did not bring them back. Refused by name, as the wire refuses it."""
    cond = PromptConditioner(HashTextEncoder(8), "a cat", device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(PromptError, match=r"transition_chunks: .* expected a whole number in \[0, 1000\]"):
        cond.request("a dog", chunks)
    with pytest.raises(PromptError, match="transition_chunks"):
        cond.set_transition_chunks(chunks)
    assert not cond.pending and cond.transition_chunks == 4
    cond.request("a dog", 0)
    cond.wait_pending(10)
    emb, _ = cond.advance()
    assert torch.isfinite(emb).all() and cond.text == "a dog"
    cond.close()


@pytest.mark.parametrize("text, words", [(None, "NoneType 'None' is not allowed; expected a non-empty text"),
                                          (7, "int '7' is not allowed"),
                                          ("x" * 4097, "4097 characters; expected at most 4096")],
                         ids=["none", "number", "too-long"])
def test_a_prompt_that_is_not_a_text_of_the_allowed_length_is_refused_by_name(text, words):
    cond = PromptConditioner(HashTextEncoder(8), "a cat", device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(PromptError, match=words):
        cond.request(text)
    cond.close()


def test_a_prompt_asked_of_a_closed_session_says_it_is_closed():
    cond = PromptConditioner(HashTextEncoder(8), "a cat", device=torch.device("cpu"), dtype=torch.float32)
    cond.close()
    with pytest.raises(RuntimeError, match="this session is closed"):  # not the pool's "after shutdown"
        cond.request("a dog")


def test_optical_flow_of_a_very_tall_frame_works_on_a_bounded_image(monkeypatch):
    """Frames are scaled to FLOW_WIDTH columns before the flow; a frame 2000 px tall and 1 px wide became
    320000 rows (a gigabyte and more per chunk); the height is capped."""
    import cv2

    from loom_live.engine.stream import motion_noise

    sizes = []
    resize = cv2.resize
    monkeypatch.setattr(cv2, "resize", lambda f, size, **kw: sizes.append(size) or resize(f, size, **kw))
    flow = OpticalFlowMotion("dis")
    flow.submit(np.zeros((2, 2000, 1, 3), np.uint8), None)
    flow._pending.result(30)
    assert flow.latest() == pytest.approx(0.0, abs=0.05)
    assert sizes and all(w == motion_noise.FLOW_WIDTH and h <= motion_noise.FLOW_MAX_HEIGHT for w, h in sizes)
    flow.close()
