"""Device copies the bridge queues without waiting (host_bridge/copies_in_flight.py, the rings' queued reads and
their read events), on the CPU stand-in of cuda-python's runtime whose "GPU" can fall behind
(tests/fakes/cuda_runtime.py)."""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime", reason="the cuda-ipc code needs cuda-python (no GPU)")

from loom_live.host_bridge.copies_in_flight import CopiesInFlight  # noqa: E402
from loom_live.host_bridge.newest_frames import NewestFrames  # noqa: E402
from loom_live.host_bridge.wire.rings import cuda as tc  # noqa: E402
from tests.fakes.cuda_runtime import FakeRuntime  # noqa: E402

STREAM = 0x5EED


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(tc, "cudart", rt)
    return rt


def waits(fake: FakeRuntime) -> int:
    return fake.host_waits[threading.get_ident()]


def test_what_a_copy_keeps_comes_back_once_the_gpu_has_passed_it_in_order(fake):
    flight = CopiesInFlight(limit=3)
    fake.behind = True
    flight.hold(STREAM, 0, "a")
    flight.hold(STREAM, 0, "b")
    assert flight.done() == [] and len(flight) == 2 and waits(fake) == 0  # asked, never waited for
    fake.catch_up()
    assert flight.done() == ["a", "b"] and flight.done() == [] and len(flight) == 0
    flight.hold(STREAM, 0, "c")
    assert flight.done() == ["c"]  # a finished event is reused, and reads as the new point only
    assert len(fake.events) == 2


def test_past_the_limit_the_oldest_copy_is_waited_for(fake):
    flight = CopiesInFlight(limit=2)
    fake.behind = True
    for kept in "abc":
        flight.hold(STREAM, 0, kept)
    assert waits(fake) == 1 and flight.waited == 1 and len(flight) == 2
    assert flight.done() == ["a"]  # the one waited for comes back; the others are still in flight
    flight.close()
    assert flight.done() == [] and len(flight) == 0 and waits(fake) == 3  # close waits for the rest, hands none
    with pytest.raises(ValueError, match="limit: 0 is not allowed"):
        CopiesInFlight(limit=0)


def test_a_queued_read_orders_the_next_write_into_its_slot_on_the_gpu(fake):
    kw = dict(transport="cuda-ipc", slots=1, width=4, height=2, channels=4, dtype="uint8", generation=0)
    buffer = tc.CudaRing.create(dir="out", **kw)
    buffer.write(0, np.full((2, 4, 4), 7, np.uint8))
    dst = np.zeros((2, 4, 4), np.uint8)
    before = waits(fake)
    buffer.read_device(0, dst.ctypes.data, stream=STREAM, wait=False)
    assert waits(fake) == before and (dst == 7).all()
    read_event = fake.recorded[-1]
    assert read_event not in buffer.events  # the slot's read event, not its write event
    buffer.write(0, np.full((2, 4, 4), 9, np.uint8))
    assert read_event in fake.waited  # the write waited for the read, on the GPU
    buffer.close()
    assert waits(fake) > before + 1  # closing waits for reads queued on other streams


def test_the_engines_next_write_into_an_output_slot_waits_for_the_hosts_queued_read(fake):
    """The host hands an output slot back as soon as its copy out is queued: the slot's read event, shared
    with the engine through the ring's description, orders the engine's next write into it on the GPU."""
    kw = dict(transport="cuda-ipc", width=4, height=2, channels=4, dtype="uint8", generation=0)
    ring = tc.CudaRing.create(dir="out", slots=3, **kw)  # made by the host, as the bridge makes both rings
    assert len(ring.spec.read_events) == 3
    engine = tc.CudaRing.attach(ring.spec)
    frame = np.full((2, 4, 4), 5, np.uint8)
    engine.write_device(1, frame.ctypes.data, 16)
    frames = NewestFrames(cuda_device=0)
    before = waits(fake)
    assert frames.read_output(ring, 1, [], on_device=True) is None
    assert waits(fake) == before  # queued: nothing waited for on the host
    read_event = fake.recorded[-1]
    assert read_event not in ring.events  # the slot's read event, not its write event
    waited = len(fake.waited)
    engine.write_device(1, frame.ctypes.data, 16)  # the slot, reused by the engine
    assert read_event in fake.waited[waited:]
    assert (frames.output_array() == 5).all()
    frames.close()
    for r in (engine, ring):
        r.close()


def test_staged_source_memory_is_kept_until_copied(fake):
    src = np.full((2, 4, 4), 3, np.uint8)

    class Memory:  # what owns TouchDesigner's copy of a texture
        pass

    frames = NewestFrames(cuda_device=0)
    fake.behind = True
    first, second = Memory(), Memory()
    alive = [weakref.ref(first), weakref.ref(second)]
    before = waits(fake)
    frames.stage_device(src.ctypes.data, 16, 4, 2, 4, "uint8", "rgb", STREAM, keep=first)
    del first
    frames.stage_device(src.ctypes.data, 16, 4, 2, 4, "uint8", "rgb", STREAM, keep=second)
    del second
    assert waits(fake) == before and all(ref() is not None for ref in alive)  # queued, both held
    fake.catch_up()
    frames.stage_device(src.ctypes.data, 16, 4, 2, 4, "uint8", "rgb", STREAM, keep=Memory())
    assert [ref() for ref in alive] == [None, None]  # copied: handed back at the next stage
    frames.stage_device(src.ctypes.data, 16, 4, 2, 4, "uint8", "rgb", STREAM)  # no keep: copied before it returns
    assert waits(fake) == before + 1 and frames.copies_waited == 0
    fake.behind = True  # the GPU falls behind: past four sources held, a stage waits for the oldest copy
    for _ in range(5):
        frames.stage_device(src.ctypes.data, 16, 4, 2, 4, "uint8", "rgb", STREAM, keep=Memory())
    assert frames.copies_waited == 1
    frames.close()


def test_closing_a_ring_waits_for_its_own_queued_reads_never_for_the_peers(fake):
    """A killed engine's last record of a read event may never complete: the host must not wait on it when it
    closes the ring, only on the reads it queued itself."""
    kw = dict(transport="cuda-ipc", slots=2, width=4, height=2, channels=4, dtype="uint8", generation=0)
    host_ring = tc.CudaRing.create(dir="in", **kw)
    engine_ring = tc.CudaRing.attach(host_ring.spec)
    out = tc.CudaRing.create(dir="out", **kw)
    engine_ring.copy_to(0, out, 0, wait=False)  # the engine's queued read of slot 0 (the pass-through's copy)
    peer_read = fake.recorded[-1]
    dst = np.zeros((2, 4, 4), np.uint8)
    host_ring.read_device(1, dst.ctypes.data, stream=STREAM, wait=False)  # the host's own queued read of slot 1
    own_read = fake.recorded[-1]
    host_ring.close()  # the engine was killed: it never closes its side
    assert own_read in fake.event_waits and peer_read not in fake.event_waits
    out.close()


def test_closing_a_ring_waits_for_writes_queued_on_a_callers_stream_only(fake):
    """The engine writes outputs on a stream of its own without waiting (engine/server/device_frames.py): its
    side of the ring must not let the memory go before those copies are done; a write it waited for, or one on
    the ring's own stream (which the close synchronises), is not waited for again by event."""
    kw = dict(transport="cuda-ipc", slots=3, width=4, height=2, channels=4, dtype="uint8", generation=0)
    host_ring = tc.CudaRing.create(dir="out", **kw)
    engine_ring = tc.CudaRing.attach(host_ring.spec)
    src = np.arange(32, dtype=np.uint8).reshape(2, 4, 4)
    fake.behind = True  # the GPU is busy: the queued copy is not done when the write returns
    before = waits(fake)
    engine_ring.write_device(0, src.ctypes.data, stream=STREAM, sync=False)
    assert waits(fake) == before and engine_ring.events[0] in fake.unfinished
    engine_ring.write_device(1, src.ctypes.data, sync=False)  # on the ring's own stream
    engine_ring.write_device(2, src.ctypes.data, stream=STREAM)  # waited for
    engine_ring.close()
    assert fake.event_waits.count(host_ring.events[0]) == 1
    assert host_ring.events[1] not in fake.event_waits and host_ring.events[2] not in fake.event_waits
    host_ring.close()
