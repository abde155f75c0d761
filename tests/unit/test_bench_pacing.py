"""`loom bench --input-fps N`: the paced input's schedule and the rate measured over it, on a clock that moves
only when slept on, so every timestamp is the schedule's own (no wall-clock bound)."""

from __future__ import annotations

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
