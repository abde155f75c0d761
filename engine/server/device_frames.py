"""Format conversion on the GPU for the cuda-ipc path (torch), with the rules of `host_bridge.wire.pixels`.

A host on cuda-ipc puts frames in its own layout into the input ring (TouchDesigner: BGRA uint8
or RGBA uint16/float32, bottom-up). The engine reads the slot into a tensor on the same GPU,
converts it to uint8 RGB top-down there, and converts the session's output back into the output
ring's layout, so a frame never crosses the CPU. The conversions are exact twins of the numpy ones
(same rounding), which the tests check.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from loom_live.engine.stream.cuda_streams import highest_priority

UINT8_MAX = 255
UINT16_MAX = 65535
TORCH_DTYPES = {"uint8": torch.uint8, "uint16": torch.uint16, "float32": torch.float32}


def to_uint8(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:
        return t
    if t.dtype == torch.uint16:
        wide = t.to(torch.int32)
        return torch.div(wide * UINT8_MAX + UINT16_MAX // 2, UINT16_MAX, rounding_mode="floor").to(torch.uint8)
    return torch.round(torch.clamp(t.to(torch.float32), 0.0, 1.0) * UINT8_MAX).to(torch.uint8)


def from_uint8(t: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "uint8":
        return t
    if dtype == "uint16":
        return (t.to(torch.int32) * 257).to(torch.uint16)
    return t.to(torch.float32) / UINT8_MAX


def to_engine(t: torch.Tensor, order: str = "RGB", bottom_up: bool = False) -> torch.Tensor:
    """[H, W, C] in a ring layout -> uint8 RGB top-down [H, W, 3], contiguous."""
    c = t.shape[2]
    if c in (1, 2):
        rgb = t[:, :, :1].expand(-1, -1, 3)
    elif order.upper().startswith("BGR"):
        rgb = torch.flip(t[:, :, :3], dims=[2])  # not a list index: that copies the index from the host and waits
    else:
        rgb = t[:, :, :3]
    if bottom_up:
        rgb = torch.flip(rgb, dims=[0])
    return to_uint8(rgb).contiguous()


def from_engine(rgb: torch.Tensor, channels: int, dtype: str, order: str, bottom_up: bool) -> torch.Tensor:
    """uint8 RGB top-down [H, W, 3] -> a ring layout (alpha opaque), contiguous."""
    if channels == 1:
        data = rgb[:, :, :1]
    else:
        data = torch.flip(rgb, dims=[2]) if order.startswith("BGR") else rgb
        if channels == 4:
            alpha = torch.full(rgb.shape[:2] + (1,), UINT8_MAX, dtype=torch.uint8, device=rgb.device)
            data = torch.cat([data, alpha], dim=2)
    if bottom_up:
        data = torch.flip(data, dims=[0])
    return from_uint8(data, dtype).contiguous()


def resize(rgb: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [H, W, 3] to another size (area when shrinking, bilinear when growing)."""
    if rgb.shape[:2] == (height, width):
        return rgb
    x = rgb.permute(2, 0, 1)[None].to(torch.float32)
    shrink = height < rgb.shape[0] and width < rgb.shape[1]
    y = F.interpolate(x, size=(height, width), mode="area" if shrink else "bilinear",
                      **({} if shrink else {"align_corners": False}))
    return torch.round(y.clamp(0, UINT8_MAX))[0].permute(1, 2, 0).to(torch.uint8)


class DeviceSlots:
    """Reads cuda-ipc slots into engine tensors and writes engine outputs into slots, on the GPU.

    A write is queued on a high-priority stream of its own and not waited for: the frame worker announces the
    slot once its event says the copy is done (`Ring.write_done`), and the ring waits for it before it closes.
    Waiting here would hold the frame worker until the conversion got its turn on a GPU busy with the next
    chunk (under MPS, beside the host's own work), and paced outputs would leave late and in bunches."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _buffer(self, ring: Any) -> torch.Tensor:
        s = ring.spec
        key = (ring.device, s.height, s.width, s.channels, s.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty((s.height, s.width, s.channels), dtype=TORCH_DTYPES[s.dtype],
                              device=f"cuda:{ring.device}")
            self._buffers = {key: buf}  # one layout at a time: a new generation replaces the old
        return buf

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device, priority=highest_priority())
            self._streams[device] = stream
        return stream

    def read(self, ring: Any, slot: int) -> torch.Tensor:
        """The slot as engine uint8 RGB top-down on the ring's GPU (the slot may be released after)."""
        buf = self._buffer(ring)
        torch.cuda.current_stream(buf.device).synchronize()
        ring.read_device(slot, buf.data_ptr(), buf.stride(0) * buf.element_size())
        s = ring.spec
        frame = to_engine(buf, s.order, s.orientation == "bottom-up")
        # an RGB uint8 top-down slot converts to itself: copy, the next read reuses the buffer
        return frame.clone() if frame.data_ptr() == buf.data_ptr() else frame

    def write(self, ring: Any, slot: int, frame: torch.Tensor | np.ndarray) -> None:
        """An engine output (tensor or array, uint8 RGB) into the slot, in the ring's layout; returns once queued."""
        s = ring.spec
        device = torch.device(f"cuda:{ring.device}")
        stream = self._stream(device)
        rgb = torch.as_tensor(frame)
        if rgb.is_cuda:  # made on the caller's stream (or handed to it): ordered after it, kept until used here
            stream.wait_stream(torch.cuda.current_stream(device))
            rgb.record_stream(stream)
        with torch.cuda.stream(stream):  # what is made here is freed for reuse on this stream, after the copy
            rgb = rgb.to(device)
            data = from_engine(resize(rgb, s.height, s.width), s.channels, s.dtype, s.order,
                               s.orientation == "bottom-up")
        ring.write_device(slot, data.data_ptr(), data.stride(0) * data.element_size(), stream=stream.cuda_stream,
                          sync=False)
