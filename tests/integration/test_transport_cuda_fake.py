"""The cuda-ipc code paths on a CPU, against a stand-in for cuda-python's runtime module.

The stand-in keeps "device" memory in host buffers (pointers are real addresses, so 2D copies with
pitch really move bytes) and an IPC handle carries the address, so a ring opened "in another
process" works within this one. It checks the bridge's own logic: slot pitch, copies from and to
raw pointers with a caller's pitch, events and streams passed where they belong, ring descriptions,
the Bridge's device staging and output buffers, and a full in-process engine round trip. The real
driver is exercised by tests/test_bridge_cuda.py on a GPU machine.
"""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

cuda_bindings = pytest.importorskip("cuda.bindings.runtime")

from engine.server.core import EngineServer  # noqa: E402
from engine.server.passthrough import PassthroughSession  # noqa: E402
from host_bridge import Bridge, BridgeConfig  # noqa: E402
from host_bridge.wire.rings import cuda as tc  # noqa: E402

OK = cuda_bindings.cudaError_t.cudaSuccess


class FakeRuntime:
    """The subset of cuda.bindings.runtime the bridge uses, on host memory."""

    cudaError_t = cuda_bindings.cudaError_t
    cudaMemcpyKind = cuda_bindings.cudaMemcpyKind
    cudaStream_t = cuda_bindings.cudaStream_t
    cudaIpcMemHandle_t = cuda_bindings.cudaIpcMemHandle_t
    cudaIpcEventHandle_t = cuda_bindings.cudaIpcEventHandle_t
    cudaEventInterprocess = cuda_bindings.cudaEventInterprocess
    cudaEventDisableTiming = cuda_bindings.cudaEventDisableTiming
    cudaIpcMemLazyEnablePeerAccess = cuda_bindings.cudaIpcMemLazyEnablePeerAccess
    cudaStreamDefault = cuda_bindings.cudaStreamDefault

    def __init__(self) -> None:
        self.buffers: dict[int, ctypes.Array] = {}
        self.events: dict[int, str] = {}
        self.recorded: list[int] = []
        self.waited: list[int] = []
        self.freed = 0

    def cudaGetDeviceCount(self):
        return OK, 1

    def cudaGetDeviceProperties(self, i):
        return OK, SimpleNamespace(uuid=SimpleNamespace(bytes=bytes(range(16))))

    def cudaSetDevice(self, i):
        assert i == 0
        return (OK,)

    def cudaPointerGetAttributes(self, ptr):
        return OK, SimpleNamespace(device=0)

    def cudaMalloc(self, size):
        buf = ctypes.create_string_buffer(size)
        ptr = ctypes.addressof(buf)
        self.buffers[ptr] = buf
        return OK, ptr

    def cudaFree(self, ptr):
        self.buffers.pop(ptr)
        self.freed += 1
        return (OK,)

    def cudaIpcGetMemHandle(self, ptr):
        assert ptr in self.buffers, "IPC handles are only for cudaMalloc'ed memory"
        h = cuda_bindings.cudaIpcMemHandle_t()
        ctypes.memmove(h.getPtr(), ctypes.c_uint64(ptr).value.to_bytes(8, "little"), 8)
        return OK, h

    def cudaIpcOpenMemHandle(self, handle, flags):
        return OK, int.from_bytes(ctypes.string_at(handle.getPtr(), 8), "little")

    def cudaIpcCloseMemHandle(self, ptr):
        return (OK,)

    def cudaEventCreateWithFlags(self, flags):
        assert flags == self.cudaEventInterprocess | self.cudaEventDisableTiming
        ev = len(self.events) + 1
        self.events[ev] = "created"
        return OK, ev

    def cudaIpcGetEventHandle(self, ev):
        h = cuda_bindings.cudaIpcEventHandle_t()
        ctypes.memmove(h.getPtr(), ev.to_bytes(8, "little"), 8)
        return OK, h

    def cudaIpcOpenEventHandle(self, handle):
        return OK, int.from_bytes(ctypes.string_at(handle.getPtr(), 8), "little")

    def cudaEventDestroy(self, ev):
        return (OK,)

    def cudaEventRecord(self, ev, stream):
        self.recorded.append(ev)
        return (OK,)

    def cudaStreamWaitEvent(self, stream, ev, flags):
        self.waited.append(ev)
        return (OK,)

    def cudaStreamCreateWithFlags(self, flags):
        return OK, cuda_bindings.cudaStream_t(0)

    def cudaStreamSynchronize(self, stream):
        return (OK,)

    def cudaStreamDestroy(self, stream):
        return (OK,)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        assert width <= dpitch and width <= spitch, "row wider than a pitch"
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return (OK,)


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
    server = EngineServer(PassthroughSession, bind="tcp://127.0.0.1:*", heartbeat_s=0.1)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while server.channel is None and time.monotonic() < deadline:
        time.sleep(0.01)
    cfg = BridgeConfig(transport="cuda-ipc", launch=False, endpoint=server.channel.endpoint, heartbeat_s=0.1,
                       hang_timeout_s=1.0)
    try:
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
    finally:
        server.request_stop()
        thread.join(10)
