"""The handoff breakdown's stamps: off by default, per-frame steps, CUDA calls timed under their step."""

from __future__ import annotations

import time

import pytest

from loom_live.host_bridge.wire import handoff_marks as hm
from loom_live.host_bridge.wire.handoff_marks import HandoffMarks, TimedCalls, call_table, merge_frames, step_table


def test_off_by_default_records_nothing():
    marks = HandoffMarks()
    marks.mark(1, "host.stage")
    assert marks.frames == {} and marks.step == "-"


def test_marks_per_frame_and_bounded(monkeypatch):
    monkeypatch.setattr(hm, "KEEP_FRAMES", 3)
    marks = HandoffMarks(enabled=True)
    for seq in range(5):
        marks.mark(seq, "host.submit", t_ns=seq * 100)
        marks.mark(seq, "host.done")
    assert sorted(marks.frames) == [2, 3, 4]  # the oldest went
    assert marks.frames[4]["host.submit"] == 400 and marks.frames[4]["host.done"] >= marks.frames[3]["host.done"]
    assert (marks.step, marks.seq) == ("host.done", 4)


def test_step_table_gaps_between_consecutive_points():
    frames = [{"a": 0, "b": 1000 * i, "c": 1000 * i + 500} for i in range(1, 6)] + [{"a": 0, "c": 9}]
    rows = step_table(frames, ["a", "b", "c"])
    assert [r["step"] for r in rows] == ["a -> b", "b -> c"]
    assert rows[0]["p50_us"] == 3.0 and rows[0]["n"] == 5 and rows[0]["min_us"] == 1.0  # the frame without b left out
    assert rows[1]["p50_us"] == rows[1]["p99_us"] == 0.5


def test_merge_frames_joins_both_sides():
    host = {"1": {"host.notice": 5}, "2": {"host.notice": 7}}
    engine = {"1": {"engine.notice": 6}}
    assert merge_frames(host, engine) == {"1": {"host.notice": 5, "engine.notice": 6}, "2": {"host.notice": 7}}


class _Runtime:
    """A module-like object: a function, a type, a constant."""

    class cudaStream_t:  # noqa: N801 - named as cuda-python names it
        pass

    cudaStreamDefault = 0

    def __init__(self):
        self.calls = 0

    def cudaStreamSynchronize(self, stream):  # noqa: N802
        self.calls += 1
        time.sleep(0.001)
        return 0, None


def test_timed_calls_times_functions_under_the_step_and_passes_the_rest():
    marks = HandoffMarks(enabled=True)
    rt = _Runtime()
    timed = TimedCalls(rt, marks)
    assert timed.cudaStream_t is _Runtime.cudaStream_t and timed.cudaStreamDefault == 0
    assert isinstance(_Runtime.cudaStream_t(), timed.cudaStream_t)
    marks.mark(7, "engine.copy")
    assert timed.cudaStreamSynchronize(None) == (0, None) and rt.calls == 1
    marks.mark(8, "engine.copy")
    timed.cudaStreamSynchronize(None)
    (seq7, ns7), _ = marks.calls["engine.copy cudaStreamSynchronize"]
    assert seq7 == 7 and ns7 >= 1_000_000  # at least the call's own sleep
    rows = call_table({k: list(v) for k, v in marks.calls.items()}, range(8, 9))
    assert [(r["call"], r["n"]) for r in rows] == [("engine.copy cudaStreamSynchronize", 1)]


def test_dump_and_load(tmp_path):
    marks = HandoffMarks(enabled=True, role="engine")
    marks.mark(3, "engine.notice", t_ns=10)
    marks.call("cudaEventRecord", 2000)
    path = marks.dump(tmp_path)
    assert path.name.startswith("handoff-engine-")
    (loaded,) = hm.load_dumps(tmp_path, "engine")
    assert loaded["frames"] == {"3": {"engine.notice": 10}}
    assert loaded["calls"] == {"engine.notice cudaEventRecord": [[3, 2000]]}
    assert hm.load_dumps(tmp_path, "host") == []


def test_cuda_ring_calls_are_timed_when_on(monkeypatch):
    pytest.importorskip("cuda.bindings.runtime", reason="the cuda-ipc ring code needs cuda-python (no GPU)")
    from loom_live.host_bridge.wire.rings import cuda as tc
    from tests.fakes.cuda_runtime import FakeRuntime

    marks = HandoffMarks(enabled=True)
    monkeypatch.setattr(tc, "MARKS", marks)
    monkeypatch.setattr(tc, "cudart", FakeRuntime())
    tc.time_calls()
    assert isinstance(tc.cudart, TimedCalls)
    tc.time_calls()  # once only
    assert not isinstance(tc.cudart._module, TimedCalls)
    ring = tc.CudaRing.create(transport="cuda-ipc", dir="in", slots=2, width=4, height=3, channels=4, dtype="uint8",
                              generation=0)
    out = tc.CudaRing.create(transport="cuda-ipc", dir="out", slots=2, width=4, height=3, channels=4, dtype="uint8",
                             generation=0)
    marks.mark(5, "engine.copy")
    ring.copy_to(0, out, 1)
    labels = {k for k, v in marks.calls.items() if any(seq == 5 for seq, _ in v)}
    assert {"engine.copy cudaStreamWaitEvent", "engine.copy cudaMemcpy2DAsync", "engine.copy cudaEventRecord",
            "engine.copy cudaStreamSynchronize"} <= labels
    ring.close()
    out.close()


def test_cuda_ring_calls_are_not_wrapped_when_off(monkeypatch):
    pytest.importorskip("cuda.bindings.runtime", reason="the cuda-ipc ring code needs cuda-python (no GPU)")
    from loom_live.host_bridge.wire.rings import cuda as tc

    monkeypatch.setattr(tc, "MARKS", HandoffMarks())
    rt = object()
    monkeypatch.setattr(tc, "cudart", rt)
    tc.time_calls()
    assert tc.cudart is rt
