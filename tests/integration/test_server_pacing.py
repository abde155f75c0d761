"""The server with a session that behaves like the real one (outputs in chunk bursts, a tail on flush).

The server runs in a thread of this process, serving on loopback tcp; the Bridge connects to it.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
import pytest

from loom_live.host_bridge import Bridge, BridgeConfig
from tests.fakes.engines import InProcessEngine, wait_until


class ChunkSession:
    """StreamSession's timing with identity content: outputs after 5 inputs, then 4 at a time; flush emits the rest."""

    accepts_device_frames = False
    raw_passthrough = False
    unfinished = 0  # every push returns what its chunks finished

    def __init__(self) -> None:
        self.pending: list[np.ndarray] = []
        self.chunk = 5

    def push(self, frames: np.ndarray) -> np.ndarray:
        if frames[0, 0, 0, 0] == 255:
            raise ValueError("frame rejected by the session")
        self.pending.extend(frames)
        out = []
        while len(self.pending) >= self.chunk:
            out += self.pending[: self.chunk]
            self.pending = self.pending[self.chunk:]
            self.chunk = 4
        return np.stack(out) if out else np.zeros((0, 1, 1, 3), np.uint8)

    def poll(self, wait: bool = False) -> np.ndarray:
        return np.zeros((0, 1, 1, 3), np.uint8)

    def flush(self) -> np.ndarray:
        out, self.pending = self.pending, []
        return np.stack(out) if out else np.zeros((0, 1, 1, 3), np.uint8)

    def while_waiting(self, fn):
        self.waiting = fn

    def set_prompt(self, text, transition_chunks=None):
        pass

    def set_params(self, **kw):
        raise ValueError(f"{next(iter(kw))}: unknown parameter")

    def reset(self):
        self.pending, self.chunk = [], 5

    def stats(self):
        return {"pending": len(self.pending)}

    def close(self) -> None:
        pass


class GpuLikeSession(ChunkSession):
    """A GPU session's contract: a push returns only chunks already finished; the newest one
    finishes DELAY_S later and is collected by `poll()` (the server must ask, no push comes)."""

    DELAY_S = 0.05

    def __init__(self) -> None:
        super().__init__()
        self.running: deque[tuple[float, np.ndarray]] = deque()

    def push(self, frames: np.ndarray) -> np.ndarray:
        done = super().push(frames)
        if len(done):
            self.running.append((time.monotonic() + self.DELAY_S, done))
        return self.poll()

    def poll(self, wait: bool = False) -> np.ndarray:
        out = []
        while self.running and (wait or self.running[0][0] <= time.monotonic()):
            out += list(self.running.popleft()[1])
        return np.stack(out) if out else np.zeros((0, 1, 1, 3), np.uint8)

    @property
    def unfinished(self) -> int:
        return len(self.running)

    def flush(self) -> np.ndarray:
        parts = [p for p in (self.poll(wait=True), super().flush()) if len(p)]
        return np.concatenate(parts) if parts else np.zeros((0, 1, 1, 3), np.uint8)

    def reset(self) -> None:
        super().reset()
        self.running.clear()


class FailingSession(ChunkSession):
    """Frames marked 254 fail inside the pipeline after being taken, as a CUDA out-of-memory error
    in the middle of a chunk would; `reset_fails`: the session cannot start a new stream either."""

    reset_fails = False

    def push(self, frames: np.ndarray) -> np.ndarray:
        if frames[0, 0, 0, 0] == 254:
            self.pending.extend(frames)
            raise RuntimeError("CUDA out of memory (simulated)")
        return super().push(frames)

    def reset(self):
        if self.reset_fails and self.pending:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        super().reset()


class BrokenSession(FailingSession):
    reset_fails = True


class BusySession(ChunkSession):
    """Restyling a chunk takes longer than one input frame interval, as the CPU model's does."""

    BUSY_S = 0.07

    def push(self, frames: np.ndarray) -> np.ndarray:
        out = super().push(frames)
        if len(out):
            time.sleep(self.BUSY_S)
        return out


class _Served(InProcessEngine):
    """A server thread on loopback tcp with a Bridge connected to it."""

    def __init__(self, session_cls) -> None:
        super().__init__(session_cls)
        self.bridge = Bridge(BridgeConfig(**self.host, heartbeat_s=0.1,
                                          hang_timeout_s=1.0)).start()
        self.bridge.wait_running(20)

    def close(self) -> None:
        self.bridge.close()
        self.stop()


@pytest.fixture(params=[ChunkSession, GpuLikeSession])
def served(request):
    s = _Served(request.param)
    try:
        yield s.bridge
    finally:
        s.close()


def test_chunked_session_is_lossless_in_order_with_the_flushed_tail(served):
    frames = [np.full((16, 24, 3), i, np.uint8) for i in range(23)]  # 5 + 4*4 + a tail of 2
    outs = served.process(frames, timeout_s=30)
    assert [int(o[0, 0, 0]) for o in outs] == list(range(23))
    with pytest.raises(ValueError, match="unknown parameter"):
        served.set_params(wait=True, strength=3)


def test_live_outputs_are_paced_not_bursty(served):
    period = 0.02
    seen, t_next = set(), time.monotonic()
    for i in range(80):
        served.submit(np.full((16, 24, 3), i % 256, np.uint8))
        t_next += period
        while time.monotonic() < t_next:
            out, status = served.latest()
            if not status.fallback:
                assert int(out[0, 0, 0]) == status.seq % 256  # each output is the frame with its seq
                seen.add(status.seq)
            time.sleep(0.003)
    time.sleep(0.2)
    delivered = served.status().frames_out
    assert delivered >= 60
    # bursts of 4 delivered at once would let a 3 ms poll see about a quarter of them
    assert len(seen) >= 0.6 * delivered, (len(seen), delivered)


def test_a_failing_frame_is_reported_and_the_stream_goes_on(served):
    served.submit(np.full((16, 24, 3), 255, np.uint8))
    deadline = time.monotonic() + 5
    while "rejected" not in served.stats()["last_error"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "frame rejected by the session" in served.stats()["last_error"]
    frames = [np.full((16, 24, 3), i, np.uint8) for i in range(9)]
    assert [int(o[0, 0, 0]) for o in served.process(frames, timeout_s=20)] == list(range(9))
    assert served.status().state == "running"


def test_a_chunk_that_finishes_after_its_push_still_reaches_the_host(served):
    """No frame comes after the second chunk: its outputs arrive because the server polls.

    Each frame goes in once the session has taken the one before: latest wins, so a frame sent while a
    loaded machine still handles the last one would replace it, and the second chunk never fills.
    Every output is delivered or counted as dropped; the host receives each one the engine sent."""
    for i in range(9):  # the first chunk (5 frames) and one more (4)
        served.submit(np.full((16, 24, 3), i, np.uint8))
        assert wait_until(lambda n=i + 1: served.engine_report(refresh=True).get("frames_in") == n, 10)
    def accounted() -> bool:  # live mode may drop an output a lagging host has no free slot for: counted
        report = served.engine_report(refresh=True)
        return report.get("frames_out", 0) + report.get("dropped_out", 0) == 9

    # all 9 accounted for: the second chunk was emitted with no frame after it (without the server's
    # polling it never is: 5). Which outputs had a slot is the machine's load: live mode may drop any.
    assert wait_until(accounted, 10), served.engine_report(refresh=True)
    report = served.engine_report(refresh=True)
    assert report["frames_out"] >= 1
    assert wait_until(lambda: served.status().frames_out == report["frames_out"], 10)


def test_a_failure_inside_the_session_starts_a_new_stream():
    """Its half-done chunk is not restyled on, and later outputs are still paired with their inputs."""
    s = _Served(FailingSession)
    try:
        bridge = s.bridge
        for i in (1, 2, 254):  # two frames taken, then one that fails inside the pipeline
            bridge.submit(np.full((16, 24, 3), i, np.uint8))
            time.sleep(0.05)
        deadline = time.monotonic() + 5
        while "out of memory" not in bridge.stats()["last_error"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "CUDA out of memory" in bridge.stats()["last_error"]
        frames = [np.full((16, 24, 3), i, np.uint8) for i in range(10, 19)]
        assert [int(o[0, 0, 0]) for o in bridge.process(frames, timeout_s=20)] == list(range(10, 19))
        deadline = time.monotonic() + 5
        while bridge.stats()["engine"].get("new_streams") != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert bridge.stats()["engine"]["new_streams"] == 1
        assert bridge.status().state == "running"
    finally:
        s.close()


def test_a_session_that_cannot_recover_ends_the_engine():
    """Exiting is what lets the host's supervisor start a fresh engine (a launched one is restarted)."""
    s = _Served(BrokenSession)
    try:
        s.bridge.submit(np.full((16, 24, 3), 254, np.uint8))
        s.thread.join(10)
        assert s.exit_code == [1]  # EXIT_SESSION_FAILED
        # the host was told why: the engine's last message reaches the bridge's thread just after it exits
        assert wait_until(lambda: "could not start a new stream" in s.bridge.stats()["last_error"], 10), \
            s.bridge.stats()["last_error"]
    finally:
        s.close()


class PollFailsSession(GpuLikeSession):
    """Pushes leave their chunks running; collecting them (the worker's poll between frames) fails."""

    def push(self, frames: np.ndarray) -> np.ndarray:
        done = ChunkSession.push(self, frames)
        if len(done):
            self.running.append((time.monotonic(), done))
        return np.zeros((0, 1, 1, 3), np.uint8)

    def poll(self, wait: bool = False) -> np.ndarray:
        raise RuntimeError("CUDA error: unspecified launch failure (simulated)")


def test_an_engine_whose_frame_worker_dies_exits_rather_than_idle_on():
    """Heartbeats alone would keep a host waiting forever on an engine that no longer takes frames."""
    s = _Served(PollFailsSession)
    try:
        for i in range(20):  # a first chunk runs, and collecting it fails in the worker's own loop
            s.bridge.submit(np.full((16, 24, 3), i, np.uint8))
            time.sleep(0.02)
        s.thread.join(10)
        assert s.exit_code == [1]
        assert "frame worker failed: RuntimeError: CUDA error" in s.bridge.stats()["last_error"]
    finally:
        s.close()


class GatedSession(ChunkSession):
    """Blocks in push while `gate` is clear (a busy worker); records (resets so far, frame value) per push."""

    gate = threading.Event()
    pushes: list[tuple[int, int]] = []
    resets = 0

    def push(self, frames: np.ndarray) -> np.ndarray:
        GatedSession.pushes.append((GatedSession.resets, int(frames[0, 0, 0, 0])))
        GatedSession.gate.wait(10)
        return super().push(frames)

    def reset(self):
        GatedSession.resets += 1
        super().reset()


def test_frames_sent_before_a_reset_do_not_open_the_new_stream():
    """A cancelled batch's frames still waiting in a busy engine belong to the stream the reset ends:
    dropped, not pushed after it (where they would change the next run's first chunk)."""
    GatedSession.gate.clear()
    GatedSession.pushes, GatedSession.resets = [], 0
    s = _Served(GatedSession)
    try:
        bridge = s.bridge
        bridge.submit(np.full((16, 24, 3), 1, np.uint8))
        assert wait_until(lambda: GatedSession.pushes, 10, 0.01)  # the worker is busy with frame 1
        for i in (2, 3):
            bridge.submit(np.full((16, 24, 3), i, np.uint8))
        bridge.reset()
        assert wait_until(lambda: not s.server.worker.commands.empty(), 10, 0.01)
        GatedSession.gate.set()
        assert wait_until(lambda: GatedSession.resets == 1, 10, 0.01)
        bridge.submit(np.full((16, 24, 3), 4, np.uint8))
        assert wait_until(lambda: any(v == 4 for _, v in GatedSession.pushes), 10, 0.01)
        assert [v for r, v in GatedSession.pushes if r >= 1] == [4]
        assert wait_until(lambda: bridge.stats()["engine"].get("dropped", 0) >= 1, 5, 0.02)
    finally:
        GatedSession.gate.set()
        s.close()


def _feed_live(bridge: Bridge, frames: int, period_s: float) -> None:
    """A live host: a frame every `period_s`, and the newest output asked for every few milliseconds between."""
    t0 = time.monotonic()
    for i in range(frames):
        bridge.submit(np.full((16, 24, 3), i, np.uint8))
        while time.monotonic() < t0 + period_s * (i + 1):
            bridge.latest()
            time.sleep(0.002)


def test_a_session_busy_longer_than_a_frame_interval_loses_no_frame_and_builds_no_lag():
    """Frames every 50 ms, each chunk restyled in 70 ms: the frames that arrive meanwhile wait (a
    few, not only the newest), and outputs paced while the worker is busy keep their times, so
    every frame comes back at the input's rate and no backlog of outputs grows (or overflows)."""
    s = _Served(BusySession)
    try:
        bridge = s.bridge
        _feed_live(bridge, 60, period_s=0.05)
        report = bridge.engine_report(refresh=True)
        # a loaded machine may stall the worker past three arrivals once or twice: a drop each time
        assert report["dropped"] <= 3 and report["dropped_out"] == 0, report
        assert report["frames_out"] >= report["frames_in"] - 4 - 3, report  # one chunk, its tail
        # the report says where the worker's time went: 14 chunks of 70 ms in its session calls, none of it waiting
        assert report["time_ms"]["session"] >= 14 * 70 and report["time_ms"]["waiting"] == 0.0, report["time_ms"]
    finally:
        s.close()


class WaitingSession(ChunkSession):
    """A GPU session's wait inside a push: the push that completes a chunk returns the chunk before it, after
    waiting BLOCK_S for it as `OutputQueue.take` does, calling the server's `while_waiting` function between looks."""

    BLOCK_S = 0.2
    blocks: list[tuple[float, float]] = []

    def push(self, frames: np.ndarray) -> np.ndarray:
        out = super().push(frames)
        if len(out):
            start = time.monotonic()
            while time.monotonic() < start + self.BLOCK_S:
                if getattr(self, "waiting", None) is not None:
                    self.waiting()
                time.sleep(0.001)
            self.blocks.append((start, time.monotonic()))
        return out


def test_outputs_fall_due_and_go_out_while_a_push_waits_for_the_gpu():
    """A GPU-bound engine spends most of its time inside the push that waits for a chunk; outputs paced to
    leave meanwhile went out in a burst when it returned, more than the output slots hold or a host showing
    one frame a refresh can see. The session calls the worker's `while_waiting` during the wait: outputs
    leave while the push still waits, and none is dropped for want of a slot."""
    WaitingSession.blocks = []
    s = _Served(WaitingSession)
    sent: list[float] = []
    worker = s.server.worker
    publish = worker._publish
    worker._publish = lambda *a: (sent.append(time.monotonic()), publish(*a))[1]
    try:
        bridge = s.bridge
        _feed_live(bridge, 60, period_s=0.02)
        assert wait_until(lambda: len(WaitingSession.blocks) >= 4, 10, 0.02)
        inside = [t for t in sent if any(a < t < b for a, b in WaitingSession.blocks)]
        assert len(inside) >= 2, (len(sent), WaitingSession.blocks)
        assert bridge.engine_report(refresh=True)["dropped_out"] == 0
    finally:
        s.close()
