"""ComfyUI's IMAGE tensors (float32 [B, H, W, 3] in 0..1, top-down RGB) to and from engine frames."""

from __future__ import annotations

import numpy as np

from loom_live.host_bridge.wire.pixels import from_uint8, to_uint8


def from_comfy(images: np.ndarray) -> np.ndarray:
    """ComfyUI IMAGE float [B, H, W, 3] in 0..1 to engine uint8 [B, H, W, 3]."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[3] not in (3, 4) or 0 in images.shape[1:3]:
        raise ValueError(f"ComfyUI IMAGE: shape {images.shape} is not allowed; expected [B, H, W, 3] with H and W "
                         "at least 1")
    if images.dtype.kind != "f":  # integers would be clipped to 0..1: a silently black and white video
        raise ValueError(f"ComfyUI IMAGE: dtype {images.dtype} is not allowed; expected float values in 0..1")
    rgb = images[..., :3].astype(np.float32, copy=False)
    bad = np.flatnonzero(~np.isfinite(rgb).reshape(len(rgb), -1).all(axis=1)) if len(rgb) else []
    if len(bad):  # the bridge refuses such a frame too: NaN would silently become black
        listed = ", ".join(str(i) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise ValueError(f"ComfyUI IMAGE: frame {listed} ({len(bad)} of {len(rgb)}) holds NaN or infinite values; "
                         "expected finite values (0..1)")
    return np.ascontiguousarray(to_uint8(rgb))


def to_comfy(frames: np.ndarray) -> np.ndarray:
    """Engine uint8 [B, H, W, 3] (or one [H, W, 3]) to ComfyUI IMAGE float32 [B, H, W, 3] in 0..1."""
    frames = np.asarray(frames)
    if frames.ndim == 3:
        frames = frames[None]
    if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"engine frames: {frames.dtype} {frames.shape}; expected uint8 [B, H, W, 3]")
    return from_uint8(frames, np.float32)
