"""What a DiT that reads its input is given beside the noisy latents: the chunk's clean latents and,
for a model built with `source_edges`, the input's edge strength.

Why the edges: a small model that restyles on a CPU has the budget of a few convolutions per latent
pixel, and the line styles (neon outlines, blueprint line work, ink and toon outlines) are drawn along
the input's edges, a per-pixel nonlinear measure that the 8x8 block codes hold only implicitly. So the
measure comes in as it is (the smoothed Sobel magnitude the styles' own edges are made of, a standard
structure control), as each frame's 8x8 blocks of it (64 values) beside that frame's codes in its
slot. The layout per latent is slot-major, [codes of frame 0, edges of frame 0, codes of frame 1, ...],
so the latent refiner's per-slot view takes each frame's codes and edges together, and the first
latent of a stream repeats frame 0 in its earlier slots as the frame VAE does.

One function for every path that builds a source (the session, the pipeline's first rank, the
training recipe), so training and streaming see the same thing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from loom_live.engine.layers.image_kernels import luma, sobel
from loom_live.engine.models.wan_dit import SOURCE_EDGE_VALUES, WanDiTConfig
from loom_live.engine.models.wan_vae import SPACE_STRIDE, TIME_STRIDE

BLUR_SIGMA = 1.1  # OpenCV's sigma for a 5x5 Gaussian kernel given sigma 0
FULL_STEP = 4.0 * 255.0  # a 3x3 Sobel across a full black-to-white step, in grey levels
# The edge strength is mostly 0-0.2 (a standard deviation near 0.04 on natural footage) where the codes
# beside it are normalised to unit deviation. A weight that starts at zero moves at the rate Adam gives
# every weight, so an input that small would be learnt from many times slower than the codes: the model
# reads it times 16 (a power of two, so a weight file can move between gains exactly).
EDGE_GAIN = 16.0


@functools.cache
def _blur(device: torch.device) -> torch.Tensor:
    """OpenCV's 5x5 Gaussian kernel on `device`, made once (as the kernels of engine/layers/image_kernels.py)."""
    r = torch.arange(-2, 3, dtype=torch.float32)
    g = torch.exp(-r * r / (2 * BLUR_SIGMA ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None].to(device)


def edge_strength(x: torch.Tensor) -> torch.Tensor:
    """Frames [N, 3, H, W] in [-1, 1] -> edge strength [N, 1, H, W] in [0, 1] (1: a full black-white
    step): the grey image blurred 5x5, its 3x3 Sobel magnitude over a full step's, as
    `engine/train/styles.py` draws its line styles from (mirrored borders as OpenCV's default)."""
    grey = ((x.float() + 1.0) * 127.5 * luma(x.device)).sum(1, keepdim=True)
    g = F.conv2d(F.pad(grey, (2, 2, 2, 2), mode="reflect"), _blur(x.device))
    grad = F.conv2d(F.pad(g, (1, 1, 1, 1), mode="reflect"), sobel(x.device))
    return (grad.square().sum(1, keepdim=True).sqrt() / FULL_STEP).clamp(0.0, 1.0)


def dit_source(cfg: WanDiTConfig, z: torch.Tensor, pixels: torch.Tensor,
               scale: float | torch.Tensor = 1.0) -> torch.Tensor | None:
    """The source a DiT of config `cfg` reads beside the noisy latents of a chunk: None for a model that
    reads none, the clean latents `z` [B, C, F, h, w] for one without edges, else each frame slot's
    codes and edges (times `EDGE_GAIN` times `scale`) side by side. `pixels` [B, 3, T, H, W] in [-1, 1]
    are the frames z was encoded from (the stream's first chunk has T = 4F - 3: its first latent repeats
    frame 0). `scale` is the edge control's strength (`control.context_scale`: 0 = the input's structure
    is not given, 1 = as trained), one number or one per sample [B] (training's edge dropout)."""
    if not cfg.source_channels:
        return None
    if not cfg.source_edges:
        return z
    if cfg.refiner_slots != TIME_STRIDE or SOURCE_EDGE_VALUES != SPACE_STRIDE ** 2:
        raise ValueError(f"source_edges: a latent's {TIME_STRIDE} frames need refiner_slots={TIME_STRIDE}, got "
                         f"{cfg.refiner_slots}")
    b, c, f, h, w = z.shape
    lead = TIME_STRIDE * f - pixels.shape[2]
    if pixels.shape[:2] != (b, 3) or lead not in (0, TIME_STRIDE - 1) \
            or pixels.shape[3:] != (h * SPACE_STRIDE, w * SPACE_STRIDE):
        raise ValueError(f"source pixels {tuple(pixels.shape)} do not match latents {tuple(z.shape)}: expected "
                         f"[{b}, 3, {TIME_STRIDE * f} or {TIME_STRIDE * f - TIME_STRIDE + 1}, "
                         f"{h * SPACE_STRIDE}, {w * SPACE_STRIDE}]")
    frames = pixels.transpose(1, 2).flatten(0, 1)  # [B*T, 3, H, W]
    edges = F.pixel_unshuffle(edge_strength(frames), SPACE_STRIDE).unflatten(0, (b, -1))  # [B, T, 64, h, w]
    if lead:
        edges = torch.cat([edges[:, :1].expand(-1, lead, -1, -1, -1), edges], dim=1)
    slots = cfg.refiner_slots
    edges = edges.unflatten(1, (f, slots)).permute(0, 2, 3, 1, 4, 5)  # [B, slot, 64, F, h, w]
    codes = z.unflatten(1, (slots, c // slots))  # [B, slot, c/slot, F, h, w]
    gain = EDGE_GAIN * _per_sample(scale, b, edges)
    return torch.cat([codes, (edges * gain).to(z.dtype)], dim=2).flatten(1, 2)


def _per_sample(scale: float | torch.Tensor, batch: int, like: torch.Tensor) -> float | torch.Tensor:
    """`scale` as a factor on edges [B, ...]: a number as it is, a tensor [B] shaped to broadcast."""
    if not isinstance(scale, torch.Tensor):
        return float(scale)
    if scale.shape != (batch,):
        raise ValueError(f"edge scale: one per sample [{batch}] expected, got {tuple(scale.shape)}")
    return scale.to(like.device, like.dtype).view(batch, *[1] * (like.dim() - 1))
