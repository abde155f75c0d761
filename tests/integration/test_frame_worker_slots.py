"""Over tcp the engine's input slots are the host's credits: a frame the engine cannot read (a payload that
does not fit the ring, a JPEG that does not decode) is dropped and counted, and its slot is handed back as
dropped, so the stream goes on. Kept, a few such frames would leave the host no slot to send in."""

from __future__ import annotations

import time

import numpy as np
import pytest

from loom_live.engine.server import frame_worker
from loom_live.engine.server.frame_worker import PACED_QUEUE_LIMIT, FrameWorker
from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.host_bridge.wire.protocol import RingSpec
from loom_live.host_bridge.wire.rings.tcp import TcpRing


class _Lane:
    def __init__(self) -> None:
        self.releases: list[tuple[int, int, bool]] = []
        self.frames: list[int] = []

    def send_release(self, slot, gen, dropped=False):
        self.releases.append((slot, gen, dropped))
        return True

    def send_frame(self, slot, seq, gen, payload=(), control=False):
        self.frames.append(seq)
        return True


def test_unreadable_tcp_frames_are_dropped_counted_and_give_their_slots_back():
    spec = dict(transport="tcp", slots=2, width=4, height=4, channels=3, dtype="uint8", pitch=12, generation=1)
    lane = _Lane()
    worker = FrameWorker(PassthroughSession, lambda *a, **k: True, lane)
    worker.session = PassthroughSession()
    worker._install(TcpRing(RingSpec(dir="in", **spec)))
    worker._install(TcpRing(RingSpec(dir="out", **spec)))
    worker._process(worker.ring_in, 0, 1, 1, [b"\0" * 10])  # 10 bytes for a 48-byte frame
    worker._process(worker.ring_in, 1, 2, 1, [b"\0" * 47])
    assert lane.releases == [(0, 1, True), (1, 1, True)]  # both slots back, marked dropped
    assert worker.counts["errors"] == 2 and "the ring's frames have 48" in worker.error
    good = np.full((4, 4, 3), 7, np.uint8)
    worker._process(worker.ring_in, 0, 3, 1, [good.tobytes()])  # the stream goes on in a slot handed back
    assert lane.releases[-1] == (0, 1, False) and worker.counts["frames_in"] == 1


def test_a_deferred_flush_that_fails_in_the_session_ends_the_stream_not_the_worker():
    """A flush naming a frame notice not yet here is finished later by the worker's loop; a failure of the
    session there (out of GPU memory, say) came out of the loop and ended the worker, so the engine exited.
    Answered as a flush that was not deferred is: an error with its id, then a new stream."""
    class FailingFlush(PassthroughSession):
        def flush(self):
            raise RuntimeError("CUDA out of memory")

    sent = []
    worker = FrameWorker(FailingFlush, lambda msg, payload=(): sent.append(msg) or True, _Lane())
    worker.session = FailingFlush()
    assert worker._defer_flush(5, until_seq=7)  # notice 7 has not come
    worker._flush_due = (5, 7, 0.0)  # ...and its time is up
    assert worker._flush_ready()
    assert [(m["type"], m.get("id"), m.get("code")) for m in sent] == [("error", 5, "flush")]
    assert "CUDA out of memory" in sent[0]["message"]
    assert worker.counts["new_streams"] == 1 and worker._flush_due is None and not worker.stop


class _ReleasingLane(_Lane):
    """A lane on which the host's releases of output slots wait until the worker reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting: list[dict] = []

    def acquire(self, blocking=True, timeout_s=-1):
        return True

    def receive(self, timeout_s):
        out, self.waiting = [m if isinstance(m, tuple) else (m, []) for m in self.waiting], []  # (notice, payload)
        return out

    def release(self):
        pass

    def refuse(self, reason):
        raise AssertionError(reason)


def _output_worker(slots: int) -> tuple[FrameWorker, _ReleasingLane]:
    """A worker with a tcp output ring of `slots` 4x4 slots (generation 1), on a lane whose releases wait."""
    spec = dict(transport="tcp", slots=slots, width=4, height=4, channels=3, dtype="uint8", pitch=12, generation=1)
    lane = _ReleasingLane()
    worker = FrameWorker(PassthroughSession, lambda *a, **k: True, lane)
    worker.session = PassthroughSession()
    worker._install(TcpRing(RingSpec(dir="out", **spec)))
    return worker, lane


def test_a_live_output_takes_a_slot_whose_release_waits_on_the_lane_rather_than_being_dropped():
    """After a long session call every output slot may look taken while the host's releases of the ones it
    has read wait, unread, on the lane; the frames that fell due meanwhile go out back to back. Dropping
    them then threw away frames the host had room for (a quarter of a 1.3B stream's beside TouchDesigner)."""
    worker, lane = _output_worker(slots=3)
    frame = np.full((4, 4, 3), 9, np.uint8)
    for seq in range(3):
        worker._emit(seq, frame)
    assert lane.frames == [0, 1, 2] and worker.out_tracker.free == 0
    lane.waiting.append({"type": "release", "slot": 1, "gen": 1})
    worker._emit(3, frame)
    assert lane.frames[-1] == 3 and worker.counts["dropped_out"] == 0
    worker._emit(4, frame)  # no release waits: a live frame with no slot is dropped and counted, never waited for
    assert lane.frames[-1] == 3 and worker.counts["dropped_out"] == 1
    assert worker.counts["dropped_out_no_slot"] == 1 and worker.counts["dropped_out_behind"] == 0


def test_live_outputs_past_the_paced_queue_drop_the_oldest_and_say_so():
    """An engine that makes frames faster than their pace lets them leave drops the oldest waiting one, counted
    apart from frames dropped for want of a slot: the two causes have different cures."""
    worker, lane = _output_worker(slots=3)
    frame = np.full((4, 4, 3), 9, np.uint8)
    for seq in range(PACED_QUEUE_LIMIT + 2):
        worker._queue_output(seq, frame)
    assert len(worker._paced) == PACED_QUEUE_LIMIT and worker._paced[0][0] == 2  # the two oldest went
    assert worker.counts["dropped_out"] == 2 and worker.counts["dropped_out_behind"] == 2
    assert worker.counts["dropped_out_no_slot"] == 0 and lane.frames == []


def test_while_a_session_waits_the_worker_takes_releases_and_sends_due_outputs_and_keeps_a_failure_for_later():
    """The function a session calls during its GPU waits does the loop's output work on time; a failure there
    must not surface inside the session's call (that would restart the stream): it is raised by the loop."""
    worker, lane = _output_worker(slots=2)
    frame = np.full((4, 4, 3), 9, np.uint8)
    worker._emit(0, frame)
    worker._emit(1, frame)
    worker._paced.extend([(2, frame, 0.0), (3, frame, time.monotonic() + 60)])  # one due, one not yet
    lane.waiting.append({"type": "release", "slot": 0, "gen": 1})
    worker._while_waiting()
    assert lane.frames == [0, 1, 2] and len(worker._paced) == 1 and worker.counts["dropped_out"] == 0
    worker._paced[0] = (3, frame, 0.0)
    worker.ring_out.write = lambda *a: (_ for _ in ()).throw(OSError("the shared memory is gone"))
    lane.waiting.append({"type": "release", "slot": 1, "gen": 1})
    worker._while_waiting()  # no raise into the session's call
    with pytest.raises(OSError, match="shared memory is gone"):
        worker._raise_waiting_failure()
    worker._raise_waiting_failure()  # raised once


def test_a_flush_takes_the_frames_sent_before_it_and_leaves_those_that_come_during_its_waits():
    """The session's GPU waits now read the lane, so a frame's notice can arrive in the middle of a flush; it
    belongs to the stream after the flush, which must end with the frames the host sent before it."""
    spec = dict(transport="tcp", slots=3, width=4, height=4, channels=3, dtype="uint8", pitch=12, generation=1)
    lane = _ReleasingLane()
    pushed = []

    class WaitingPassthrough(PassthroughSession):
        raw_passthrough = False

        def push(self, frames, control=None):
            pushed.append(int(frames[0, 0, 0, 0]))
            worker._while_waiting()  # as a GPU session's wait does
            return super().push(frames)

    worker = FrameWorker(WaitingPassthrough, lambda *a, **k: True, lane)
    worker.session = WaitingPassthrough()
    worker.lossless = True
    worker._install(TcpRing(RingSpec(dir="in", **spec)))
    worker._install(TcpRing(RingSpec(dir="out", **spec)))
    for seq in (1, 2):
        worker._take_notice({"type": "frame", "slot": seq - 1, "seq": seq, "gen": 1},
                            [np.full((4, 4, 3), seq, np.uint8).tobytes()])
    lane.waiting.append(({"type": "frame", "slot": 2, "seq": 3, "gen": 1}, [np.full((4, 4, 3), 3, np.uint8).tobytes()]))
    worker._flush()
    assert pushed == [1, 2] and lane.frames == [1, 2]
    assert [seq for _, seq, *_ in worker.inputs] == [3]


def test_paced_outputs_that_leave_over_a_pace_step_after_they_fell_due_are_counted(monkeypatch):
    """Outputs that fall due while the worker is held elsewhere (inside a long session call) leave together,
    and a host that shows one frame a refresh sees only the last of them: the count says how often, apart from
    the drops, so a bench can tell the engine's pace from the host's reads."""
    worker, lane = _output_worker(slots=4)
    frame = np.full((4, 4, 3), 9, np.uint8)
    worker._interval = 0.05  # a pace step of 47.5 ms
    clock = [10.0]
    monkeypatch.setattr(frame_worker.time, "monotonic", lambda: clock[0])
    for seq in range(3):
        worker._queue_output(seq, frame)  # due at 10.0, 10.0475 and 10.095
    clock[0] = 10.0575  # the first is 57.5 ms past due, the second 10 ms: only the first is late
    worker._emit_due()
    assert lane.frames == [0, 1] and worker.counts["out_late"] == 1
    clock[0] = 10.3
    worker._emit_due()
    assert lane.frames == [0, 1, 2] and worker.counts["out_late"] == 2
    assert worker.counts["dropped_out"] == 0


def test_the_worker_says_how_long_it_spent_reading_inside_session_calls_waiting_there_and_sending(monkeypatch):
    """Outputs that leave late together mean the worker was held in a session call: its time split into the
    call's waits for the GPU (where it sends due outputs) and the rest tells a bench which of the two held it."""
    from loom_live.engine.server import worker_time

    clock = [0.0]
    monkeypatch.setattr(worker_time.time, "perf_counter", lambda: clock[0])
    spec = dict(transport="tcp", slots=3, width=4, height=4, channels=3, dtype="uint8", pitch=12, generation=1)
    lane = _ReleasingLane()

    class SlowSession(PassthroughSession):
        raw_passthrough = False

        def push(self, frames, control=None):
            clock[0] += 0.030  # launching the chunk's work: no chance to send
            for _ in range(3):  # then three looks at the GPU, 10 ms apart
                worker._while_waiting()
                clock[0] += 0.010
            return super().push(frames)

    worker = FrameWorker(SlowSession, lambda *a, **k: True, lane)
    worker.session = SlowSession()
    worker.lossless = True  # outputs leave as they come, each through the timed send
    worker._install(TcpRing(RingSpec(dir="in", **spec)))
    worker._install(TcpRing(RingSpec(dir="out", **spec)))
    write = worker.ring_out.write

    def slow_write(slot, frame):  # writing the frame into its slot takes 2 ms, the rest of the send none
        clock[0] += 0.002
        return write(slot, frame)

    worker.ring_out.write = slow_write
    worker._process(worker.ring_in, 0, 1, 1, [np.full((4, 4, 3), 5, np.uint8).tobytes()])
    assert lane.frames == [1]
    spent = worker.time.report()
    assert spent["session"] == pytest.approx(60.0) and spent["waiting"] == pytest.approx(20.0)  # first to last look
    assert spent["emit"] == spent["write"] == pytest.approx(2.0)  # the send: all of it the write into the slot
    assert spent["read"] == 0.0  # the fixed clock did not move there
    for _ in range(2):  # looks outside a timed session call (a flush's waits) are not counted as its waiting
        worker._while_waiting()
        clock[0] += 0.010
    assert worker.time.report()["waiting"] == pytest.approx(20.0)
