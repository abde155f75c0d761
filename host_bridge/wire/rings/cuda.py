"""The frame ring in GPU memory, shared between processes with CUDA IPC (through cuda-python).

Slots are plain `cudaMalloc` buffers (never a framework's caching allocator: IPC handles refer to
whole allocations) exported with `cudaIpcGetMemHandle`. Each slot has one interprocess event
(`cudaEventInterprocess | cudaEventDisableTiming`): the writer records it on its stream after the
copy into the slot and only then publishes the slot index; the reader makes its own stream wait
on that event before it copies out, and synchronises that stream before it releases the slot.
A read the reader does not wait for (`wait=False`) records the slot's second interprocess event
(`read_events`) instead, and the next write into that slot, in either process, waits for it on
the GPU: the slot can go back at once, and a queued read never sees a newer frame half-written.
No CPU ever touches the pixels. GPUs are named by UUID because device indices differ between
processes with different `CUDA_VISIBLE_DEVICES`.

cuda-python is optional: importing this module without it works; creating a ring raises
`TransportUnavailable`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from loom_live.host_bridge.wire.handoff_marks import MARKS, TimedCalls
from loom_live.host_bridge.wire.protocol import RingSpec
from loom_live.host_bridge.wire.rings.base import Ring, TransportUnavailable, packed_pitch

try:
    from cuda.bindings import runtime as cudart
except ImportError:  # pragma: no cover - depends on the install
    try:
        from cuda import cudart  # cuda-python before 12.6 named the module this way
    except ImportError:
        cudart = None

IPC_HANDLE_BYTES = 64
PITCH_ALIGN = 256  # row alignment of slots: coalesced copies


def time_calls() -> None:
    """With handoff marks on (a breakdown run), every CUDA runtime call below is timed under its step."""
    global cudart
    if cudart is not None and MARKS.enabled and not isinstance(cudart, TimedCalls):
        cudart = TimedCalls(cudart, MARKS)


time_calls()


def cuda_available() -> tuple[bool, str]:
    """Whether cuda-ipc can work here, and why not."""
    if cudart is None:
        return False, "cuda-python is not installed"
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count == 0:
        return False, f"no usable CUDA device ({_name(err)})"
    return True, f"{count} device(s)"


def _name(err: Any) -> str:
    return getattr(err, "name", str(err))


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python call result `(err, *values)`; raise with the call name on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {_name(err)}")
    return values[0] if len(values) == 1 else (values or None)


def event_done(event: Any) -> bool:
    """Whether the GPU has passed `event`'s last record; never waits."""
    result = cudart.cudaEventQuery(event)
    err = result[0] if isinstance(result, tuple) else result
    if err == cudart.cudaError_t.cudaErrorNotReady:
        return False
    check(result, "cudaEventQuery")
    return True


def _require() -> None:
    ok, why = cuda_available()
    if not ok:
        raise TransportUnavailable(f"cuda-ipc transport unavailable: {why}")


def device_uuid(index: int) -> str:
    raw = bytes(check(cudart.cudaGetDeviceProperties(index), "cudaGetDeviceProperties").uuid.bytes)[:16]
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def device_by_uuid(uuid: str) -> int:
    count = check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount")
    for i in range(count):
        if device_uuid(i) == uuid:
            return i
    raise TransportUnavailable(f"GPU {uuid} is not visible to this process ({count} device(s) visible)")


def pointer_device(ptr: int) -> int:
    """The device that owns a device pointer (TouchDesigner's cudaMemory().ptr, a tensor's data_ptr())."""
    attrs = check(cudart.cudaPointerGetAttributes(ptr), "cudaPointerGetAttributes")
    return int(attrs.device)


def all_uuids() -> list[str]:
    if cudart is None:
        return []
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess:
        return []
    return [device_uuid(i) for i in range(count)]


def _to_hex(handle: Any) -> str:
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES).hex()


def _from_hex(cls: Any, text: str) -> Any:
    raw = bytes.fromhex(text)
    if len(raw) != IPC_HANDLE_BYTES:
        raise ValueError(f"CUDA IPC handle of {len(raw)} bytes; expected {IPC_HANDLE_BYTES}")
    handle = cls()
    ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
    return handle


def as_stream(stream: Any) -> Any:
    """A cuda-python stream handle from an int (TouchDesigner's handles) or a handle; 0 or None: the legacy default."""
    return stream if isinstance(stream, cudart.cudaStream_t) else cudart.cudaStream_t(int(stream or 0))



class CudaRing(Ring):
    """Slots in device memory; `write_device`/`read_device` move frames from/to raw device pointers."""

    on_device = True
    copies_slots = True

    def __init__(self, spec: RingSpec, device: int, ptrs: list[int], events: list[Any], owner: bool,
                 read_events: list[Any] | None = None):
        self.spec = spec
        self.device = device
        self.ptrs = ptrs
        self.events = events
        self._owner = owner
        check(cudart.cudaSetDevice(device), "cudaSetDevice")
        # a blocking stream on purpose: work the caller queued on the legacy default stream (torch's
        # default, many apps') completes before our copies start, without the caller syncing
        self.stream = check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamDefault), "cudaStreamCreate")
        # per slot: its last read nobody waited for (shared with the peer process; a ring described without them,
        # a host's own one-slot buffers among them, makes plain ones when first needed)
        self._read_events: list[Any] = list(read_events) if read_events else [None] * len(ptrs)
        self._reads_marked: set[int] = set()  # slots whose read event this process recorded
        self._writes_queued: set[int] = set()  # slots written on a caller's stream without waiting (`write_device`)
        self._closed = False

    @classmethod
    def create(cls, *, device: int = 0, **fields: Any) -> CudaRing:
        _require()
        check(cudart.cudaSetDevice(device), "cudaSetDevice")
        pitch = packed_pitch(fields["width"], fields["channels"], fields["dtype"], PITCH_ALIGN)
        size = pitch * fields["height"]
        ptrs, events, read_events, handles, event_handles, read_handles = [], [], [], [], [], []
        flags = cudart.cudaEventInterprocess | cudart.cudaEventDisableTiming
        try:
            for _ in range(fields["slots"]):
                ptr = check(cudart.cudaMalloc(size), "cudaMalloc")
                ptrs.append(ptr)
                handles.append(_to_hex(check(cudart.cudaIpcGetMemHandle(ptr), "cudaIpcGetMemHandle")))
                for made, exported in ((events, event_handles), (read_events, read_handles)):
                    event = check(cudart.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")
                    made.append(event)
                    exported.append(_to_hex(check(cudart.cudaIpcGetEventHandle(event), "cudaIpcGetEventHandle")))
        except Exception:
            for p in ptrs:
                cudart.cudaFree(p)
            for e in events + read_events:
                cudart.cudaEventDestroy(e)
            raise
        spec = RingSpec(pitch=pitch, handles=handles, events=event_handles, read_events=read_handles,
                        gpu_uuid=device_uuid(device), **fields)
        return cls(spec, device, ptrs, events, owner=True, read_events=read_events)

    @classmethod
    def attach(cls, spec: RingSpec) -> CudaRing:
        _require()
        if spec.gpu_uuid is None or len(spec.handles) != spec.slots or len(spec.events) != spec.slots \
                or len(spec.read_events) not in (0, spec.slots):
            raise ValueError("cuda-ipc ring: needs a GPU UUID and one memory and one event handle per slot "
                             "(and one read event per slot, or none)")
        device = device_by_uuid(spec.gpu_uuid)
        check(cudart.cudaSetDevice(device), "cudaSetDevice")
        ptrs = []
        for mem_hex in spec.handles:
            handle = _from_hex(cudart.cudaIpcMemHandle_t, mem_hex)
            ptrs.append(check(cudart.cudaIpcOpenMemHandle(handle, cudart.cudaIpcMemLazyEnablePeerAccess),
                              "cudaIpcOpenMemHandle"))
        events, read_events = ([check(cudart.cudaIpcOpenEventHandle(_from_hex(cudart.cudaIpcEventHandle_t, h)),
                                      "cudaIpcOpenEventHandle") for h in hexes]
                               for hexes in (spec.events, spec.read_events))
        return cls(spec, device, ptrs, events, owner=False, read_events=read_events)

    # -- device pointers (the zero-copy path) -------------------------------------------------------

    def write_device(self, slot: int, src: int, src_pitch: int | None = None, *, wait_event: Any = None,
                     sync: bool = True, stream: Any = None, first_row: int = 0, rows: int | None = None) -> None:
        """Copy a frame from device memory into `slot`, then record the slot's event.

        `stream`: the caller's stream the source was produced on (TouchDesigner's cudaMemory
        stream); the copy is queued behind that work, and behind the slot's last queued read. `sync`
        waits for the copy before returning, so the caller may free or reuse the source at once;
        without it the source must live until the copy is done (`CopiesInFlight` keeps it), and `close`
        waits for a copy left on the caller's stream before the memory goes.
        `first_row`, `rows`: write only those rows of the slot (one half of a control ring's slot).
        """
        self.check_slot(slot)
        rows = self.spec.height - first_row if rows is None else rows
        if first_row < 0 or rows < 1 or first_row + rows > self.spec.height:
            raise ValueError(f"rows {first_row}..{first_row + rows - 1} are outside the slot's {self.spec.height}")
        row = self.spec.row_bytes
        s = self.stream if stream is None else as_stream(stream)
        check(cudart.cudaSetDevice(self.device), "cudaSetDevice")
        if wait_event is not None:
            check(cudart.cudaStreamWaitEvent(s, wait_event, 0), "cudaStreamWaitEvent")
        self._after_reads(slot, s)
        check(cudart.cudaMemcpy2DAsync(self.ptrs[slot] + first_row * self.spec.pitch, self.spec.pitch, src,
                                       src_pitch or row, row, rows, cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                                       s), "cudaMemcpy2DAsync")
        check(cudart.cudaEventRecord(self.events[slot], s), "cudaEventRecord")
        if sync:
            check(cudart.cudaStreamSynchronize(s), "cudaStreamSynchronize")
        elif stream is not None:  # not on this ring's own stream: `close` waits for it by the slot's event
            self._writes_queued.add(slot)

    def read_device(self, slot: int, dst: int, dst_pitch: int | None = None, *, stream: Any = None,
                    wait: bool = True) -> None:
        """Copy `slot` into device memory after the writer's event; returns when the copy is done
        (a slot released right after must have been read). `wait` false: returns once the copy is
        queued on `stream`; work queued after it there sees the frame, and the next write into this
        slot waits for the read on the GPU."""
        self.check_slot(slot)
        row = self.spec.row_bytes
        s = self.stream if stream is None else as_stream(stream)
        check(cudart.cudaSetDevice(self.device), "cudaSetDevice")
        check(cudart.cudaStreamWaitEvent(s, self.events[slot], 0), "cudaStreamWaitEvent")
        check(cudart.cudaMemcpy2DAsync(dst, dst_pitch or row, self.ptrs[slot], self.spec.pitch, row, self.spec.height,
                                       cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, s), "cudaMemcpy2DAsync")
        if wait:
            check(cudart.cudaStreamSynchronize(s), "cudaStreamSynchronize")
        else:
            self._mark_read(slot, s)

    def copy_to(self, slot: int, other: CudaRing, other_slot: int, first_row: int = 0, *, wait: bool = True) -> None:
        """Slot to slot on the GPU (the pass-through engine; a staged frame into an input slot, or into one
        half of a control ring's slot from `first_row` on): waits on this slot's event, records other's.
        `wait` false: returns once queued on `other`'s stream; a reader of `other` orders itself by the
        recorded event, the next write into this slot waits for the read on the GPU, and
        `other.wait_writes()` says when this slot has been read (before it is handed back)."""
        if other.spec.row_bytes != self.spec.row_bytes:
            raise ValueError(f"slot rows of {self.spec.row_bytes} bytes do not fit rows of {other.spec.row_bytes}")
        other.write_device(other_slot, self.ptrs[slot], self.spec.pitch, wait_event=self.events[slot],
                           first_row=first_row, rows=self.spec.height, sync=wait)
        if not wait:
            self._mark_read(slot, other.stream)

    def _mark_read(self, slot: int, stream: Any) -> None:
        """A read of `slot` queued on `stream` that nobody waits for: the next write into the slot (in this
        process or the peer's) waits for it."""
        event = self._read_events[slot]
        if event is None:
            event = check(cudart.cudaEventCreateWithFlags(cudart.cudaEventDisableTiming), "cudaEventCreateWithFlags")
            self._read_events[slot] = event
        check(cudart.cudaEventRecord(event, stream), "cudaEventRecord")
        self._reads_marked.add(slot)

    def _after_reads(self, slot: int, stream: Any) -> None:
        """Order a write into `slot` on `stream` after the slot's last read nobody waited for (on the GPU)."""
        event = self._read_events[slot]
        if event is not None:
            check(cudart.cudaStreamWaitEvent(stream, event, 0), "cudaStreamWaitEvent")

    def write_done(self, slot: int) -> bool:
        """Whether the last write into `slot` is done on the GPU (its event); never waits."""
        self.check_slot(slot)
        return event_done(self.events[slot])

    def wait_writes(self) -> None:
        """Return when the copies queued on this ring's own stream are done."""
        check(cudart.cudaSetDevice(self.device), "cudaSetDevice")
        check(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    # -- host arrays (for hosts without device memory of their own, and tests) --------------------------

    def write(self, slot: int, frame: np.ndarray) -> list[Any]:
        self.check_slot(slot)
        self.check_frame(frame)
        frame = np.ascontiguousarray(frame)
        row = self.spec.row_bytes
        check(cudart.cudaSetDevice(self.device), "cudaSetDevice")
        self._after_reads(slot, self.stream)
        check(cudart.cudaMemcpy2DAsync(self.ptrs[slot], self.spec.pitch, frame.ctypes.data, row, row, self.spec.height,
                                       cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream), "cudaMemcpy2DAsync")
        check(cudart.cudaEventRecord(self.events[slot], self.stream), "cudaEventRecord")
        check(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        return []

    def read(self, slot: int, payload: list[bytes]) -> np.ndarray:
        self.check_slot(slot)
        out = np.empty(self.shape, self.spec.dtype)
        row = self.spec.row_bytes
        check(cudart.cudaSetDevice(self.device), "cudaSetDevice")
        check(cudart.cudaStreamWaitEvent(self.stream, self.events[slot], 0), "cudaStreamWaitEvent")
        check(cudart.cudaMemcpy2DAsync(out.ctypes.data, row, self.ptrs[slot], self.spec.pitch, row, self.spec.height,
                                       cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream), "cudaMemcpy2DAsync")
        check(cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cudart.cudaSetDevice(self.device)
        cudart.cudaStreamSynchronize(self.stream)
        # this process's reads and writes queued on other streams end before the memory goes; a peer's record is
        # never waited for here (a killed peer's last one may never complete): a peer waits for its own reads before
        # it hands a slot back, or (the host) owns the memory and closes its rings after its own reads
        for slot in self._writes_queued:
            cudart.cudaEventSynchronize(self.events[slot])
        for slot, event in enumerate(self._read_events):
            if event is not None:
                if slot in self._reads_marked:
                    cudart.cudaEventSynchronize(event)
                cudart.cudaEventDestroy(event)
        for ptr in self.ptrs:
            if self._owner:
                cudart.cudaFree(ptr)
            else:
                cudart.cudaIpcCloseMemHandle(ptr)
        for event in self.events:
            cudart.cudaEventDestroy(event)
        cudart.cudaStreamDestroy(self.stream)
        self.ptrs, self.events = [], []
