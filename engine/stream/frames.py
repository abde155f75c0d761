"""Frames in and out of the model: validation, resizing to the model resolution, [-1, 1] tensors.

The model runs at a fixed resolution; hosts send whatever size they have. Input frames are
resized on the compute device (one upload of uint8, resizing and scaling there), and outputs are
mapped back onto the input's size by the inverse of the same policy:
- stretch: resize both ways, aspect ignored;
- fit: letterbox into the model frame; the output cuts the letterbox away again;
- crop: the model sees the centre crop that fills its frame; the restyled crop is pasted back
  over that region, and the pixels outside it pass through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

ACCEPTED_DTYPES = ("uint8", "float16", "float32", "float64")
SHRINK_BAND_ROWS = 256  # a huge input is area-shrunk this many rows at a time, so its float copy stays small


class FrameError(ValueError):
    """Frames the engine cannot take; the message says what was wrong and what is allowed."""


def validate_frames(frames: np.ndarray | torch.Tensor) -> tuple[np.ndarray | torch.Tensor, int]:
    """Check a batch of RGB frames; returns (uint8 frames [N, H, W, 3], number of frames dropped).

    numpy arrays from hosts, or torch tensors (a GPU-side host such as the cuda-ipc server passes
    device tensors, which stay on the device). uint8 frames are taken as they are; float frames
    are taken as 0..1 and those holding NaN or inf are dropped (counted, the stream goes on).
    Anything else is refused with a FrameError.
    """
    is_tensor = isinstance(frames, torch.Tensor)
    if not (is_tensor or isinstance(frames, np.ndarray)):
        raise FrameError(f"frames must be a numpy array [N, H, W, 3], got {type(frames).__name__}")
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise FrameError(f"frames must be RGB with shape [N, H, W, 3] or [H, W, 3], got shape {tuple(frames.shape)}")
    if frames.shape[1] == 0 or frames.shape[2] == 0:
        raise FrameError(f"frames have zero size {frames.shape[1]}x{frames.shape[2]}")
    dtype = str(frames.dtype).removeprefix("torch.")
    if dtype not in ACCEPTED_DTYPES:
        raise FrameError(f"frames have dtype {dtype}; allowed: uint8 (0..255) or float (0..1)")
    if dtype == "uint8":
        return (frames.contiguous() if is_tensor else np.ascontiguousarray(frames)), 0
    if is_tensor:
        finite = torch.isfinite(frames).flatten(1).all(dim=1)
        good = frames[finite]
        return (good.clamp(0.0, 1.0) * 255.0 + 0.5).to(torch.uint8), int((~finite).sum())
    finite = np.isfinite(frames).all(axis=(1, 2, 3))
    good = frames[finite]
    return (np.clip(good, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8), int((~finite).sum())


@dataclass(frozen=True)
class Placement:
    """Where the model frame sits relative to an input frame of one size."""

    in_h: int
    in_w: int
    box: tuple[int, int, int, int]  # (top, left, height, width) of the region the model sees / fills
    model_box: tuple[int, int, int, int]  # the same region inside the model frame


def placement(in_h: int, in_w: int, out_h: int, out_w: int, policy: str) -> Placement:
    if policy == "stretch":
        return Placement(in_h, in_w, (0, 0, in_h, in_w), (0, 0, out_h, out_w))
    if policy == "crop":
        scale = max(out_h / in_h, out_w / in_w)
        ch, cw = min(in_h, round(out_h / scale)), min(in_w, round(out_w / scale))
        return Placement(in_h, in_w, ((in_h - ch) // 2, (in_w - cw) // 2, ch, cw), (0, 0, out_h, out_w))
    if policy == "fit":
        scale = min(out_h / in_h, out_w / in_w)
        fh, fw = max(1, round(in_h * scale)), max(1, round(in_w * scale))
        return Placement(in_h, in_w, (0, 0, in_h, in_w), ((out_h - fh) // 2, (out_w - fw) // 2, fh, fw))
    raise FrameError(f"resize policy {policy!r} is not allowed; expected crop, fit or stretch")


class FrameMapper:
    """Moves frames between host uint8 arrays and model tensors in [-1, 1] at the model size."""

    def __init__(self, width: int, height: int, policy: str, device: torch.device, dtype: torch.dtype) -> None:
        self.width, self.height, self.policy = width, height, policy
        self.device, self.dtype = device, dtype

    def to_model(self, frames_u8: np.ndarray | torch.Tensor) -> torch.Tensor:
        """uint8 [T, H, W, 3] (host array or tensor) -> [T, 3, height, width] in [-1, 1] on the device."""
        if isinstance(frames_u8, torch.Tensor):
            t = frames_u8.to(self.device, non_blocking=True)
        else:
            t = _to_device(torch.from_numpy(frames_u8), self.device)
        p = placement(frames_u8.shape[1], frames_u8.shape[2], self.height, self.width, self.policy)
        top, left, h, w = p.box
        mt, ml, mh, mw = p.model_box
        x = _area_shrink(t[:, top:top + h, left:left + w], min(h // mh, w // mw) // 2)
        h, w = x.shape[2:]
        if (h, w) != (mh, mw):
            x = F.interpolate(x, size=(mh, mw), mode="bilinear", antialias=True, align_corners=False)
        if (mh, mw) != (self.height, self.width):
            canvas = torch.zeros(x.shape[0], 3, self.height, self.width, device=x.device)
            canvas[:, :, mt:mt + mh, ml:ml + mw] = x
            x = canvas
        return (x / 127.5 - 1.0).to(self.dtype)

    def to_host(self, x: torch.Tensor, inputs_u8: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[T, 3, height, width] in [-1, 1] -> uint8 [T, H, W, 3] at the size of `inputs_u8` (the
        chunk's own input frames, whose borders the crop and fit policies keep), on x's device.

        The placement comes from those frames, not from the latest `to_model` call: with stream-batch
        and overlapping chunks, newer frames of another size may already be on their way in.
        The result stays on the device (no host sync here): the session hands it to a device caller
        as it is (the cuda-ipc server writes it straight into the output slot) and copies it to
        pinned host memory for a numpy caller, without waiting.
        """
        p = placement(inputs_u8.shape[1], inputs_u8.shape[2], self.height, self.width, self.policy)
        mt, ml, mh, mw = p.model_box
        top, left, h, w = p.box
        out = torch.cat([_to_uint8(x[i:i + 1, :, mt:mt + mh, ml:ml + mw].float(), (h, w))  # a frame at a time:
                         for i in range(x.shape[0])])  # the float copy at input size is one frame's
        if (h, w) == (p.in_h, p.in_w):
            return out
        if isinstance(inputs_u8, torch.Tensor):
            full = inputs_u8.to(out.device, copy=True)
        else:
            full = _to_device(torch.from_numpy(np.array(inputs_u8)), out.device)  # a copy: never the caller's
        full[:, top:top + h, left:left + w] = out
        return full


def _area_shrink(t_u8: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [T, H, W, 3] -> float32 [T, 3, H // k, W // k], each pixel the mean of its k x k block,
    converted a band of rows at a time: a huge input frame never exists in float32 at full size."""
    if k <= 1:
        return t_u8.permute(0, 3, 1, 2).to(torch.float32)
    rows, cols = t_u8.shape[1] // k * k, t_u8.shape[2] // k * k
    band = max(k, SHRINK_BAND_ROWS // k * k)
    return torch.cat([F.avg_pool2d(t_u8[:, r:min(r + band, rows), :cols].permute(0, 3, 1, 2).to(torch.float32), k)
                      for r in range(0, rows, band)], dim=2)


def _to_uint8(y: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[1, 3, h, w] in [-1, 1] -> uint8 [1, H, W, 3] at `size`."""
    if tuple(y.shape[2:]) != size:
        y = F.interpolate(y, size=size, mode="bilinear", antialias=True, align_corners=False)
    return ((y.clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def vae_layout(device: torch.device) -> torch.memory_format:
    """The layout of the pixels a session hands its VAE: channels-last on a GPU (cuDNN's faster 3D convs)."""
    return torch.channels_last_3d if device.type == "cuda" else torch.contiguous_format


def vae_pixels(frames: torch.Tensor, layout: torch.memory_format) -> torch.Tensor:
    """Model-size frames [N, 3, H, W] as the VAE's input [1, 3, N, H, W] in `layout` (`vae_layout`)."""
    return frames.permute(1, 0, 2, 3)[None].contiguous(memory_format=layout)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto the device without a host sync (through pinned memory on CUDA)."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
