"""The frames `latest()` answers with: the newest output, and the last input as the fallback.

A host's frame loop asks for output every frame and must never wait for the engine, so the bridge
keeps the newest output and the last submitted input ready here. On the host transports they are
read-only numpy arrays (every caller gets the same array); on cuda-ipc they are one-slot device
buffers (`CudaRing`), so a frame stays on the GPU from the host's texture to the engine and back,
and is only brought to host memory when a caller asks for a numpy array. The input buffer doubles
as the staging copy the bridge hands to the engine's input ring. Device copies out of a slot are
queued, not waited for (the slot's next writer waits for them on the GPU), and so are copies in
from a host that gives what owns its source memory, kept in `CopiesInFlight` until copied.
cuda-python is imported only when a device buffer is made. The bridge calls into this object with
its own lock held.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from loom_live.host_bridge.wire import pixels as formats

INPUTS_IN_FLIGHT = 4  # a host's source buffers kept for queued copies, at most (then the oldest is waited for)


class NewestFrames:
    def __init__(self, cuda_device: int) -> None:
        self.cuda_device = cuda_device  # where host frames are staged on cuda-ipc
        self.last_input: np.ndarray | None = None  # host transports: the last submitted frame
        self.staging: Any = None  # cuda-ipc: device copy of the last submitted frame
        # cuda-ipc, VACE: device copy of that frame's control frame (the staging's layout), and whether it
        # holds the control frame of the frame staged now (False: that frame came without one)
        self.control_staging: Any = None
        self.control_staged = False
        self.output: np.ndarray | None = None  # host transports: the newest output
        self.output_device: Any = None  # cuda-ipc: device copy of the newest output
        self.seq = -1  # input sequence number the newest output came from
        self.link_id = -1  # the link (engine instance) it came from
        self._inputs_in_flight: Any = None  # cuda-ipc: CopiesInFlight of the host's source memory

    @property
    def copies_waited(self) -> int:
        """How often a host's queued copies fell so far behind that a call waited for the oldest."""
        return 0 if self._inputs_in_flight is None else self._inputs_in_flight.waited

    @property
    def has_output(self) -> bool:
        return self.output_device is not None or self.output is not None

    # -- inputs ---------------------------------------------------------------------------------------

    def keep_input(self, frame: np.ndarray) -> None:
        frame.setflags(write=False)  # shared with latest() callers as the fallback
        self.last_input = frame

    def stage_host(self, frame: np.ndarray, layout: str, control: np.ndarray | None = None) -> None:
        """Copy a host frame, in its own layout, into the device staging buffer, and its control frame
        (of the frame's shape and dtype; None: it has none) into the control staging buffer."""
        h, w, c = frame.shape
        self._staging_for(w, h, c, frame.dtype.name, layout).write(0, frame)
        if control is not None:
            self._staging_for(w, h, c, frame.dtype.name, layout, control=True).write(0, control)
        self.control_staged = control is not None

    def stage_device(self, ptr: int, pitch: int, width: int, height: int, channels: int, dtype: str,
                     layout: str, stream: int | None, control: tuple[int, int] | None = None,
                     keep: Any = None) -> None:
        """Copy a frame in device memory into the staging buffer (on the device that holds `ptr`), and its
        control frame (`control`: pointer and pitch of a frame of the same size, channels and dtype).
        Returns once copied; given `keep` (what owns the source memory), once queued, `keep` held until
        the GPU has copied."""
        staging = self._staging_for(width, height, channels, dtype, layout, device_ptr=ptr)
        staging.write_device(0, ptr, pitch, stream=stream, sync=keep is None)
        if control is not None:
            buffer = self._staging_for(width, height, channels, dtype, layout, device_ptr=ptr, control=True)
            buffer.write_device(0, control[0], control[1], stream=stream, sync=keep is None)
        self.control_staged = control is not None
        if keep is not None:
            if self._inputs_in_flight is None:
                from loom_live.host_bridge.copies_in_flight import CopiesInFlight

                self._inputs_in_flight = CopiesInFlight(INPUTS_IN_FLIGHT)
            self._inputs_in_flight.done()  # the source memory of copies the GPU has finished goes back to the host
            self._inputs_in_flight.hold(staging.stream if stream is None else stream, staging.device, keep)

    def _staging_for(self, width: int, height: int, channels: int, dtype: str, layout: str,
                     device_ptr: int | None = None, control: bool = False) -> Any:
        from loom_live.host_bridge.wire.rings.cuda import CudaRing, pointer_device

        order = (formats.touchdesigner_order(dtype, channels) if layout == "touchdesigner"
                 else {1: "R", 3: "RGB", 4: "RGBA"}.get(channels, "RGB"))
        orientation = "bottom-up" if layout == "touchdesigner" else "top-down"
        s = self.control_staging if control else self.staging
        key = (width, height, channels, dtype, order, orientation)
        if s is None or (s.spec.width, s.spec.height, s.spec.channels, s.spec.dtype, s.spec.order,
                         s.spec.orientation) != key:
            device = pointer_device(device_ptr) if device_ptr is not None else self.cuda_device
            if s is not None:
                s.close()
            s = CudaRing.create(device=device, transport="cuda-ipc", dir="in", slots=1, generation=0, width=width,
                                height=height, channels=channels, dtype=dtype, order=order, orientation=orientation)
            if control:
                self.control_staging = s
            else:
                self.staging = s
        return s

    # -- outputs --------------------------------------------------------------------------------------

    def read_output(self, ring: Any, slot: int, payload: list[bytes], on_device: bool) -> np.ndarray | None:
        """Take an output slot's frame: into the device buffer (`on_device`; returns None) or as a
        read-only host array. Raises ValueError/RuntimeError for a frame that does not fit the ring.
        Either way the slot may go back when this returns: the device copy is only queued, and the
        engine's next write into the slot waits for it on the GPU."""
        if on_device:
            self.output_device = _device_buffer_like(self.output_device, ring)
            ring.copy_to(slot, self.output_device, 0, wait=False)
            return None
        frame = ring.read(slot, payload)
        frame.setflags(write=False)  # every latest() caller gets this same array
        return frame

    def set_newest(self, frame: np.ndarray | None, seq: int, link_id: int) -> None:
        """Record the output just read (`frame` None when it went to the device buffer)."""
        self.output, self.seq, self.link_id = frame, seq, link_id

    def output_array(self) -> np.ndarray | None:
        """The newest output as a host array (uint8 RGB, top-down)."""
        if self.output_device is not None:
            return _to_host(self.output_device)
        return self.output

    def fallback_array(self) -> np.ndarray | None:
        """The last input as a host array, shown while there is no output to show."""
        if self.staging is not None:
            return _to_host(self.staging)
        return self.last_input

    def close(self) -> None:
        if self._inputs_in_flight is not None:
            self._inputs_in_flight.close()
            self._inputs_in_flight = None
        for dev in (self.staging, self.control_staging, self.output_device):
            if dev is not None:
                dev.close()
        self.staging = self.control_staging = self.output_device = None


class DeviceFrame(NamedTuple):
    """A frame in device memory a host hands over beside another (a VACE control frame)."""

    ptr: int
    pitch: int
    width: int
    height: int
    channels: int
    dtype: str


def check_device_frame(pitch: int, width: int, height: int, channels: int, dtype: str) -> None:
    """Refuse, with a clear reason, a device frame description the staging buffer cannot hold."""
    if channels not in (1, 3, 4):
        raise ValueError(f"channels: {channels} is not allowed; expected 1, 3 or 4")
    if dtype not in formats.DTYPE_NAMES:
        raise ValueError(f"dtype: {dtype} is not allowed; expected one of {', '.join(formats.DTYPE_NAMES)}")
    if width < 1 or height < 1:
        raise ValueError(f"size: {width}x{height} is not allowed; expected at least 1x1")
    row = width * channels * np.dtype(dtype).itemsize
    if pitch < row:
        raise ValueError(f"pitch: {pitch} bytes is smaller than one row ({row} bytes)")


def _to_host(buffer: Any) -> np.ndarray:
    spec = buffer.spec
    return formats.to_engine(buffer.read(0, []), order=spec.order, bottom_up=spec.orientation == "bottom-up")


def _device_buffer_like(current: Any, ring: Any) -> Any:
    """A one-slot device buffer shaped like the output ring (`current` when it already is)."""
    from loom_live.host_bridge.wire.rings.cuda import CudaRing

    s = ring.spec
    if current is not None and (current.spec.width, current.spec.height, current.spec.channels,
                                current.spec.dtype) == (s.width, s.height, s.channels, s.dtype):
        return current
    if current is not None:
        current.close()
    return CudaRing.create(device=ring.device, transport="cuda-ipc", dir="out", slots=1, generation=0, width=s.width,
                           height=s.height, channels=s.channels, dtype=s.dtype, order=s.order,
                           orientation=s.orientation)
