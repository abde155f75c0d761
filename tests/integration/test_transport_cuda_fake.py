"""The cuda-ipc code paths on a CPU, against a stand-in for cuda-python's runtime module
(tests/fakes/cuda_runtime.py: host buffers as device memory, IPC handles that carry the address).

It checks the bridge's own logic: slot pitch, copies from and to raw pointers with a caller's pitch,
events and streams passed where they belong, ring descriptions, the Bridge's device staging and output
buffers, and a full in-process engine round trip. The real
driver is exercised by tests/integration/test_bridge_cuda.py on a GPU machine.
"""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime", reason="the cuda-ipc ring code needs cuda-python (no GPU)")

from loom_live.engine.server.frame_worker import FrameWorker  # noqa: E402
from loom_live.engine.server.passthrough import PassthroughSession  # noqa: E402
from loom_live.host_bridge import Bridge, BridgeConfig  # noqa: E402
from loom_live.host_bridge.newest_frames import DeviceFrame  # noqa: E402
from loom_live.host_bridge.wire.pixels import to_touchdesigner  # noqa: E402
from loom_live.host_bridge.wire.rings import cuda as tc  # noqa: E402
from tests.fakes.cuda_runtime import FakeRuntime, HostDeviceSlots  # noqa: E402
from tests.fakes.engines import InProcessEngine, indexed_frame, wait_until  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(tc, "cudart", rt)
    return rt


def test_ring_copies_with_pitch_and_orders_with_events(fake):
    ring = tc.CudaRing.create(transport="cuda-ipc", dir="in", slots=3, width=5, height=4, channels=4,
                              dtype="float32", generation=2, order="RGBA", orientation="bottom-up")
    spec = ring.spec
    assert spec.pitch % tc.PITCH_ALIGN == 0 and spec.pitch >= 5 * 4 * 4
    assert len(spec.handles) == len(spec.events) == 3 and spec.gpu_uuid.startswith("GPU-00010203-0405")
    peer = tc.CudaRing.attach(spec)  # "the engine"
    frame = np.random.default_rng(0).random((4, 5, 4), dtype=np.float32)
    padded = np.zeros((4, 8, 4), np.float32)  # a caller's buffer with a wider pitch (TouchDesigner, torch views)
    padded[:, :5] = frame
    ring.write_device(1, padded.ctypes.data, padded.strides[0])
    assert fake.recorded[-1] == ring.events[1]  # recorded after the copy, before anyone reads
    assert np.array_equal(peer.read(1, []), frame)
    assert fake.waited[-1] == peer.events[1]  # the reader waited on the writer's event
    out = tc.CudaRing.create(transport="cuda-ipc", dir="out", slots=3, width=5, height=4, channels=4,
                             dtype="float32", generation=2)
    peer.copy_to(1, out, 2)
    dst = np.zeros((4, 6, 4), np.float32)
    out.read_device(2, dst.ctypes.data, dst.strides[0])
    assert np.array_equal(dst[:, :5], frame) and not dst[:, 5:].any()
    for r in (peer, ring, out):
        r.close()
    assert fake.freed == 6  # the owner frees its slots; the peer only closes its mappings


def test_bridge_round_trip_through_an_engine_on_cuda_ipc(fake):
    with InProcessEngine(PassthroughSession) as engine:
        cfg = BridgeConfig(transport="cuda-ipc", **engine.host, heartbeat_s=0.1,
                           hang_timeout_s=1.0)
        with Bridge(cfg) as bridge:
            bridge.wait_running(10)
            assert bridge.stats()["lane_endpoint"].startswith("doorbell:")  # notices through shared memory
            h, w = 6, 10
            bgra = np.random.default_rng(1).integers(0, 256, (h, w, 4), dtype=np.uint8)  # TouchDesigner layout
            for _ in range(3):
                bridge.submit_cuda(bgra.ctypes.data, bgra.strides[0], w, h, 4, "uint8", layout="touchdesigner")
                assert bridge.wait_for_output(bridge.last_seq, 5), bridge.status()
            back = np.zeros_like(bgra)
            status = bridge.latest_cuda(back.ctypes.data, back.strides[0])
            assert not status.fallback and np.array_equal(back, bgra)  # slot to slot, layout preserved
            rgb, status = bridge.latest()  # numpy view: converted to engine RGB top-down
            assert np.array_equal(rgb, bgra[::-1, :, [2, 1, 0]])
            frames = [np.full((4, 8, 3), i, np.uint8) for i in range(5)]
            outs = bridge.process(frames, timeout_s=10)
            assert [int(o[0, 0, 0]) for o in outs] == list(range(5))
            assert bridge.stats()["refused"] == 0


def test_a_host_that_queues_its_copies_never_waits_for_the_gpu_and_gets_every_frame_whole(fake):
    """TouchDesigner's cook: `submit_cuda(keep=...)` and `latest_cuda(wait=False)` only queue device copies on
    the host's stream; the bridge holds what owns the source memory until the GPU has copied it."""

    class Memory:  # TouchDesigner's CUDAMemory: the source frame's owner
        def __init__(self, value: int) -> None:
            self.frame = np.full((6, 10, 4), value, np.uint8)

    stream = 0x7D
    with InProcessEngine(PassthroughSession) as engine:
        with Bridge(BridgeConfig(transport="cuda-ipc", **engine.host, heartbeat_s=0.1)) as bridge:
            bridge.wait_running(10)
            back = np.zeros((6, 10, 4), np.uint8)
            kept = []
            for value in range(1, 13):
                memory = Memory(value)
                kept.append(weakref.ref(memory))
                before = fake.host_waits[threading.get_ident()]
                bridge.submit_cuda(memory.frame.ctypes.data, 40, 10, 6, 4, "uint8", layout="touchdesigner",
                                   stream=stream, keep=memory)
                del memory
                assert bridge.wait_for_output(bridge.last_seq, 5), bridge.status()
                status = bridge.latest_cuda(back.ctypes.data, 40, stream=stream, wait=False)
                if value > 2:  # past the first frames' ring set-up
                    assert fake.host_waits[threading.get_ident()] == before, f"frame {value}: the host waited"
                assert not status.fallback and (back == value).all(), f"frame {value}: {np.unique(back)}"
            gc.collect()
            assert sum(ref() is not None for ref in kept) <= 1  # only the newest copy may still hold its source
            assert bridge.stats()["refused"] == 0 and bridge.stats()["copies_waited"] == 0


def test_outputs_a_host_finds_together_go_back_unread_but_the_newest(fake):
    """A latest-wins host that finds several engine outputs waiting shows the newest: the older slots go back
    without a copy out, counted as superseded, and every output still counts as received."""
    with InProcessEngine(PassthroughSession) as engine:
        with Bridge(BridgeConfig(transport="cuda-ipc", **engine.host, heartbeat_s=0.1)) as bridge:
            bridge.wait_running(10)
            frames = [np.full((6, 10, 4), v, np.uint8) for v in (10, 20, 30)]
            for frame in frames:  # on cuda-ipc only the host's own calls read the lane: none until latest_cuda
                bridge.submit_cuda(frame.ctypes.data, 40, 10, 6, 4, "uint8", layout="touchdesigner")
            worker = engine.server.worker
            assert wait_until(lambda: worker.counts["frames_out"] == 3, 10), worker.counts
            back = np.zeros((6, 10, 4), np.uint8)
            status = bridge.latest_cuda(back.ctypes.data, 40)
            stats = bridge.stats()
            assert not status.fallback and status.seq == bridge.last_seq and (back == 30).all()
            assert stats["superseded"] == 2 and stats["received"] == 3


def test_staged_frames_fill_one_half_of_a_control_slot_each(fake):
    """The frame goes where the engine reads its upper half (the lower half in memory when bottom-up)."""
    for orientation, frame_row in [("top-down", 0), ("bottom-up", 3)]:
        kind = dict(transport="cuda-ipc", dir="in", width=5, channels=4, dtype="uint8", order="BGRA",
                    orientation=orientation)
        ring = tc.CudaRing.create(slots=2, height=6, generation=1, control=True, **kind)
        assert ring.spec.half_rows == (frame_row, 3 - frame_row)
        frame, control = (np.full((3, 5, 4), v, np.uint8) for v in (7, 9))
        staged = []
        for data in (frame, control):
            staged.append(tc.CudaRing.create(slots=1, height=3, generation=0, **kind))
            staged[-1].write(0, data)
        staged[0].copy_to(0, ring, 1, ring.spec.half_rows[0])
        staged[1].copy_to(0, ring, 1, ring.spec.half_rows[1])
        slot = ring.read(1, [])
        assert (slot[frame_row:frame_row + 3] == 7).all() and (slot[3 - frame_row:6 - frame_row] == 9).all()
        with pytest.raises(ValueError, match="outside the slot"):
            staged[0].copy_to(0, ring, 1, 4)
        for r in (*staged, ring):
            r.close()


def test_control_frames_travel_in_their_frames_slot_on_cuda_ipc(fake, monkeypatch):
    """Host arrays and device frames with their control frames, through a real engine server whose
    pass-through session records the control frames it gets; misfits are refused and counted, the
    frames go on."""
    monkeypatch.setattr(FrameWorker, "_gpu", lambda self: HostDeviceSlots())
    rgbs = [indexed_frame(i, 6, 10) for i in range(5)]
    controls = [255 - f for f in rgbs]
    td = [to_touchdesigner(f) for f in rgbs]  # TouchDesigner's device layout: BGRA, bottom-up
    td_controls = [to_touchdesigner(c) for c in controls]
    with InProcessEngine(PassthroughSession) as engine:
        with Bridge(BridgeConfig(transport="cuda-ipc", **engine.host, heartbeat_s=0.1)) as bridge:
            bridge.wait_running(20)
            outs = bridge.process(td[:2], timeout_s=30, layout="touchdesigner", control=td_controls[:2])
            assert all(np.array_equal(o, f) for o, f in zip(outs, rgbs))
            outs = bridge.process(rgbs[2:3], timeout_s=30, control=controls[2:3])  # top-down RGB
            assert np.array_equal(outs[0], rgbs[2])
            frame, control = td[3], td_controls[3]
            bridge.submit_cuda(frame.ctypes.data, frame.strides[0], 10, 6, 4, "uint8", layout="touchdesigner",
                               control=DeviceFrame(control.ctypes.data, control.strides[0], 10, 6, 4, "uint8"))
            assert bridge.wait_for_output(bridge.last_seq, 10), bridge.status()
            report = _session_control(bridge)
            assert report["frames"] == 4 and report["missing"] == 0
            assert report["sum"] == sum(int(c.astype(np.int64).sum()) for c in controls[:4])
            small = td_controls[4][:4]
            bridge.submit_cuda(td[4].ctypes.data, td[4].strides[0], 10, 6, 4, "uint8", layout="touchdesigner",
                               control=DeviceFrame(small.ctypes.data, small.strides[0], 10, 4, 4, "uint8"))
            assert bridge.wait_for_output(bridge.last_seq, 10)
            assert "control frame 10x4 4-channel uint8; the frame is 10x6" in bridge.stats()["last_error"]
            bridge.submit(td[4], layout="touchdesigner", control=np.zeros((6, 10, 4), np.float32))
            assert bridge.wait_for_output(bridge.last_seq, 10)
            stats = bridge.stats()
            assert stats["refused_control"] == 2 and "must be 4-channel uint8 too" in stats["last_error"]
            out, status = bridge.latest()
            assert np.array_equal(out, rgbs[4]) and not status.fallback
            report = _session_control(bridge)
            assert report["frames"] == 4 and report["missing"] == 2
            assert stats["engine"]["errors"] == 0 and stats["refused"] == 0


def _session_control(bridge: Bridge) -> dict:
    """What the pass-through session recorded, in order with the frames before (a request it answers)."""
    bridge.set_params(noise_scale=0.5, wait=True)
    return bridge.engine_report(refresh=True)["session"]["control"]


class _OrderLane:
    """A lane that notes what the worker sends, and the CUDA calls made between the sends."""

    def __init__(self, log: list):
        self.log = log

    def send_frame(self, slot, seq, gen, payload=(), control=False):
        self.log.append(("frame", slot))

    def send_release(self, slot, gen, dropped=False):
        self.log.append(("release", slot))


def test_passthrough_publishes_before_it_waits_and_releases_after(fake, monkeypatch):
    """The engine's slot-to-slot copy: the output notice goes as soon as the copy is queued (the host's read
    waits on the slot's event), the input slot goes back only after the copy's stream is synchronised."""
    log: list = []
    real_sync = fake.cudaStreamSynchronize
    monkeypatch.setattr(fake, "cudaStreamSynchronize", lambda s: (log.append(("sync", int(s))), real_sync(s))[1])
    kw = dict(transport="cuda-ipc", slots=2, width=4, height=3, channels=4, dtype="uint8", generation=0)
    ring_in, ring_out = tc.CudaRing.create(dir="in", **kw), tc.CudaRing.create(dir="out", **kw)
    frame = np.arange(48, dtype=np.uint8).reshape(3, 4, 4)
    ring_in.write(1, frame)
    worker = FrameWorker(PassthroughSession, lambda *a: True, _OrderLane(log))
    worker.session = PassthroughSession()
    worker._install(ring_in)
    worker._install(ring_out)
    log.clear()
    assert worker._raw_copy(ring_in, 1, seq=9)
    out_slot = log[0][1]
    assert log == [("frame", out_slot), ("sync", int(ring_out.stream)), ("release", 1)]
    assert np.array_equal(ring_out.read(out_slot, []), frame)
    for r in (ring_in, ring_out):
        r.close()


class _QueuedWrites:
    """The engine's slot writer as it works on a GPU (`DeviceSlots.write`): the copy is only queued."""

    def write(self, ring, slot, frame):
        ring.write_device(slot, frame.ctypes.data, stream=0x5EED, sync=False)


class _NoticeLane:
    def __init__(self) -> None:
        self.frames: list[int] = []

    def send_frame(self, slot, seq, gen, payload=(), control=False):
        self.frames.append(seq)
        return True


def test_an_output_is_announced_once_its_copy_into_the_slot_is_done(fake, monkeypatch):
    """A host that waits for its reads (a TouchDesigner build whose calls take no stream) must never wait for the
    engine's copy behind the model's work: the notice goes once the GPU has done the copy, and the worker only
    looks (it never waits for it). A copy still running when a new generation of rings comes is never announced."""
    monkeypatch.setattr(FrameWorker, "_gpu", lambda self: _QueuedWrites())
    lane = _NoticeLane()
    worker = FrameWorker(PassthroughSession, lambda *a, **k: True, lane)
    worker.session = PassthroughSession()
    kw = dict(transport="cuda-ipc", dir="out", slots=2, width=4, height=4, channels=3, dtype="uint8")
    worker._install(tc.CudaRing.create(generation=1, **kw))
    worker.lossless = True  # each output is written as it comes
    frame = np.full((4, 4, 3), 9, np.uint8)
    fake.behind = True  # the GPU is busy: the copy is queued, not done
    worker._emit(7, frame)
    worker._emit_due()
    assert lane.frames == [] and worker.counts["frames_out"] == 0
    assert fake.host_waits[threading.get_ident()] == 0  # looked at, never waited for
    fake.catch_up()
    worker._emit_due()
    assert lane.frames == [7] and worker.counts["frames_out"] == 1
    fake.behind = True
    worker._emit(8, frame)
    worker._install(tc.CudaRing.create(generation=2, **kw))  # the host's new rings: the old slots go
    fake.catch_up()
    worker._emit_due()
    assert lane.frames == [7] and not worker._written
    worker.close_rings(remove=False)
