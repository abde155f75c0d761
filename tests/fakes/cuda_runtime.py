"""A stand-in for the part of cuda-python's runtime module (`cuda.bindings.runtime`) the bridge uses, on a CPU.

"Device" memory is host buffers (pointers are real addresses, so 2D copies with pitch really move
bytes), and an IPC handle carries the address, so a ring opened "in another process" works within
this one. Copies run when queued; a test can still have the "GPU" fall behind (`behind`): events
recorded meanwhile read as not done until the host waits for them or `catch_up()`, and every host
wait is counted per thread (`host_waits`), so a test sees what a caller waited for and what it only
queued. Enum and handle types are cuda-python's own: importing this module needs cuda-python
installed (no GPU).
"""

from __future__ import annotations

import ctypes
import threading
from collections import Counter
from types import SimpleNamespace

from cuda.bindings import runtime as cuda_bindings

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
    cudaStreamNonBlocking = cuda_bindings.cudaStreamNonBlocking

    def __init__(self) -> None:
        self.buffers: dict[int, ctypes.Array] = {}
        self.events: dict[int, str] = {}
        self.recorded: list[int] = []
        self.waited: list[int] = []
        self.freed = 0
        self._next_stream = 0x1000  # distinct non-zero handles, as the driver's are
        self.streams: set[int] = set()  # live streams made by cudaStreamCreateWithFlags
        self.destroyed_streams: set[int] = set()
        self.behind = False  # events recorded now stay unfinished until waited for or caught up
        self.unfinished: set[int] = set()
        self.event_waits: list[int] = []  # the events cudaEventSynchronize waited for
        self.host_waits: Counter[int] = Counter()  # cudaStreamSynchronize and cudaEventSynchronize calls, per thread

    def catch_up(self) -> None:
        """The "GPU" finishes all it was given."""
        self.behind = False
        self.unfinished.clear()

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
        assert flags in (self.cudaEventInterprocess | self.cudaEventDisableTiming, self.cudaEventDisableTiming)
        ev = len(self.events) + 1
        self.events[ev] = "created"
        return OK, ev

    def cudaEventQuery(self, ev):
        return (cuda_bindings.cudaError_t.cudaErrorNotReady if ev in self.unfinished else OK,)

    def cudaEventSynchronize(self, ev):
        self.host_waits[threading.get_ident()] += 1
        self.event_waits.append(ev)
        self.unfinished.discard(ev)
        return (OK,)

    def cudaIpcGetEventHandle(self, ev):
        h = cuda_bindings.cudaIpcEventHandle_t()
        ctypes.memmove(h.getPtr(), ev.to_bytes(8, "little"), 8)
        return OK, h

    def cudaIpcOpenEventHandle(self, handle):
        return OK, int.from_bytes(ctypes.string_at(handle.getPtr(), 8), "little")

    def cudaEventDestroy(self, ev):
        return (OK,)

    def _use(self, stream) -> None:
        """The real runtime dereferences a stream handle: a destroyed one crashes the process."""
        if int(stream) in self.destroyed_streams:
            raise AssertionError(f"stream {int(stream):#x} used after cudaStreamDestroy (a segfault on a GPU)")

    def cudaEventRecord(self, ev, stream):
        self._use(stream)
        self.recorded.append(ev)
        if self.behind:
            self.unfinished.add(ev)
        else:
            self.unfinished.discard(ev)
        return (OK,)

    def cudaStreamWaitEvent(self, stream, ev, flags):
        self._use(stream)
        self.waited.append(ev)
        return (OK,)

    def cudaStreamCreateWithFlags(self, flags):
        handle, self._next_stream = self._next_stream, self._next_stream + 1
        self.streams.add(handle)
        return OK, cuda_bindings.cudaStream_t(handle)

    def cudaStreamSynchronize(self, stream):
        self._use(stream)
        self.host_waits[threading.get_ident()] += 1
        self.unfinished.clear()  # one stream's wait may cover others' work: counted as all done
        return (OK,)

    def cudaStreamDestroy(self, stream):
        self._use(stream)
        self.streams.discard(int(stream))
        self.destroyed_streams.add(int(stream))
        return (OK,)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):
        self._use(stream)
        assert width <= dpitch and width <= spitch, "row wider than a pitch"
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return (OK,)


class HostDeviceSlots:
    """The engine's cuda-ipc slot reader and writer (engine/server/device_frames.py) over the stand-in's
    host memory: the slot is copied out with the ring's own `read`, then the engine's torch conversions
    run on a CPU tensor, so the layout rules a GPU applies are the ones checked here."""

    def read(self, ring, slot: int):
        import torch

        from loom_live.engine.server.device_frames import to_engine

        s = ring.spec
        return to_engine(torch.from_numpy(ring.read(slot, [])), s.order, s.orientation == "bottom-up")

    def write(self, ring, slot: int, frame) -> None:
        import torch

        from loom_live.engine.server.device_frames import from_engine, resize

        s = ring.spec
        data = from_engine(resize(torch.as_tensor(frame), s.height, s.width), s.channels, s.dtype, s.order,
                           s.orientation == "bottom-up")
        ring.write(slot, data.numpy())
