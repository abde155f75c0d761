"""`loom bench --input-fps N`: the paced input's schedule and the rate measured over it, on a clock that moves
only when slept on, so every timestamp is the schedule's own (no wall-clock bound)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.stream.metrics import StreamMetrics
from loom_live.engine.tools import bench
from loom_live.engine.tools.bench import push_due, stream_fps

NO_FRAMES = np.zeros((0, 1, 1, 3), np.uint8)


class SleptClock:
    """`time.perf_counter` and `time.sleep` of a clock that moves only by what is slept."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)


class SwitchingSession:
    """A stream-batch pipeline that computes in no time: each push returns the chunk pushed before it (one
    held), until its plan switches to sequential at push `switch_at`, which lets the held chunk out with its own."""

    device = torch.device("cpu")

    def __init__(self, clock: SleptClock, switch_at: int) -> None:
        self.metrics = StreamMetrics(clock=clock.perf_counter)
        self.switch_at, self.pushes, self.held = switch_at, 0, NO_FRAMES

    def push(self, frames: np.ndarray) -> np.ndarray:
        self.metrics.on_input(len(frames))
        self.pushes += 1
        if self.pushes >= self.switch_at:
            out, self.held = np.concatenate([self.held, frames]), NO_FRAMES
        else:
            out, self.held = self.held, frames
        self.metrics.on_output(len(out))
        return out

    def poll(self, wait: bool = False) -> np.ndarray:
        return NO_FRAMES

    def stats(self) -> dict:
        return self.metrics.snapshot()

    def close(self) -> None:
        pass


def test_a_paced_push_goes_once_its_last_frame_has_come():
    assert [push_due(10.0, n, 40.0) for n in range(4, 41, 4)] == pytest.approx([10.0 + k / 10 for k in range(1, 11)])
    assert push_due(10.0, 10, 40.0) == pytest.approx(10.25)  # a last push of 2 frames waits for those 2 only
    assert push_due(10.0, 40, 0.0) == 10.0  # unpaced: at once


def test_the_rate_counts_the_frames_pushed_over_the_time_they_took():
    assert stream_fps(40, 1.0) == 40.0 and stream_fps(3000, 60.0) == 50.0
    assert stream_fps(40, 0.0) == 0.0


def test_a_stream_paced_at_40_fps_reports_40_when_a_plan_switch_lets_a_held_chunk_out(monkeypatch):
    """The 40 frames of the CPU default, paced at 40 FPS, take a second; 44 frames come out in it (the chunk the
    pipeline held from the warm-up, and at the end none held after the switch), which read as 44 FPS."""
    clock = SleptClock()
    session = SwitchingSession(clock, switch_at=6)  # the warm-up's 2 pushes, then the 4th measured one
    monkeypatch.setattr(bench, "time", clock)
    monkeypatch.setattr(bench, "open_session", lambda cfg: session)
    frames = np.zeros((9 + 40, 1, 1, 3), np.uint8)
    stats = bench.run_loom(load_config("tiny-random"), frames, warmup=9, input_fps=40.0)
    assert stats["frames_out"] == 44 and stats["measured_frames"] == 40
    assert stats["fps"] == pytest.approx(40.0, rel=1e-3)


class UnitSession:
    """A stream that runs its frames in units of work, `frame_s` a frame on the slept clock: the first `first`
    frames, then every `unit` (the Wan family's chunks, the edit family's batches). Frames short of a unit wait
    for the next push, as in the real sessions."""

    device = torch.device("cpu")

    def __init__(self, clock: SleptClock, first: int, unit: int, frame_s: float = 0.01) -> None:
        self.clock, self.first, self.unit, self.frame_s = clock, first, unit, frame_s
        self.metrics = StreamMetrics(clock=clock.perf_counter)
        self.held = self.ran = 0

    def push(self, frames: np.ndarray) -> np.ndarray:
        self.metrics.on_input(len(frames))
        self.held += len(frames)
        ran = 0
        while self.held >= (size := self.unit if self.ran + ran else self.first):
            self.held, ran = self.held - size, ran + size
        self.clock.sleep(ran * self.frame_s)
        self.ran += ran
        self.metrics.on_output(ran)
        return np.zeros((ran, 1, 1, 3), np.uint8)

    def poll(self, wait: bool = False) -> np.ndarray:
        return NO_FRAMES

    def stats(self) -> dict:
        return {**self.metrics.snapshot(), "plan": {"mode": "sequential", "chunk_latents": 1}}

    def close(self) -> None:
        pass


def _bench(argv: list[str], session: Callable, clock: SleptClock, monkeypatch, tmp_path) -> dict:
    """`loom bench ARGV` on the slept clock with `session(cfg)` for the stream (and no encoder timings); its JSON."""
    from loom_live.engine.tools import bench_edit
    from loom_live.plugin.cli.main import main

    monkeypatch.setattr(bench, "time", clock)
    monkeypatch.setattr(bench, "open_session", session)
    monkeypatch.setattr(bench_edit, "_encoder", lambda cfg: (None, torch.device("cpu")))
    monkeypatch.setattr(bench_edit, "encoder_amortisation", lambda cfg, encoder, device: {})
    monkeypatch.setattr(bench_edit, "encoder_parts", lambda cfg, encoder, device: [])
    out = tmp_path / "bench.json"
    assert main(["bench", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_an_edit_run_measures_whole_batches_and_runs_every_frame_it_counts(monkeypatch, tmp_path, capsys):
    """At B=16 the Wan family's 9 warm-up frames filled no batch: they ran inside the timed window with 39 of the
    40 measured, 48 frames run and 40 counted (a stream running 100 frames/s read 83)."""
    clock = SleptClock()
    result = _bench(["-c", "edit-tiny", "--batches", "16,6", "--frames", "40", "--warmup", "9"],
                    lambda cfg: UnitSession(clock, cfg.edit.batch, cfg.edit.batch), clock, monkeypatch, tmp_path)
    runs = result["edit"]["runs"]
    # the frames counted over the time of the frames run: the stream's own rate when the two are the same
    assert [runs[b]["fps"] for b in ("16", "6")] == pytest.approx([100.0, 100.0])
    assert (runs["16"]["warmup_frames"], runs["16"]["measured_frames"]) == (16, 48)
    assert (runs["6"]["warmup_frames"], runs["6"]["measured_frames"]) == (12, 42)
    captured = capsys.readouterr()
    assert "B=16 48 frames after 16, B=6 42 frames after 12" in captured.err
    assert re.search(r"B=16 frames measured +48 after 16 warm-up", captured.out)


def test_a_wan_run_rounds_its_measured_span_to_whole_chunks_and_says_so(monkeypatch, tmp_path, capsys):
    """`--frames 10` pushed 4 + 4 + 2: the last 2 waited for a chunk that never came, counted and never run."""
    clock = SleptClock()
    result = _bench(["-c", "tiny-random", "--frames", "10", "--warmup", "9", "--bridge", "none"],
                    lambda cfg: UnitSession(clock, 5, 4), clock, monkeypatch, tmp_path)
    assert result["loom"]["fps"] == pytest.approx(100.0) and result["loom"]["measured_frames"] == 12
    assert "--frames 10 rounded up to 12 (whole chunks of 4)" in capsys.readouterr().err


def test_whole_spans_and_a_span_run_loom_would_miscount_is_refused(monkeypatch):
    wan, edit = load_config("tiny-random"), load_config("edit-tiny", ["edit.batch=16"])
    assert [bench.whole_span(wan, w, n) for w, n in ((0, 8), (9, 10), (10, 1))] == [(5, 8), (9, 12), (13, 4)]
    assert [bench.whole_span(edit, w, n) for w, n in ((0, 8), (9, 40), (17, 48))] == [(16, 16), (16, 48), (32, 48)]
    clock = SleptClock()
    monkeypatch.setattr(bench, "open_session", lambda cfg: UnitSession(clock, 16, 16))
    with pytest.raises(ValueError, match=r"whole_span gives \(16, 48\)"):
        bench.run_loom(edit, np.zeros((9 + 40, 1, 1, 3), np.uint8), warmup=9, input_fps=0.0)
