"""The training losses of the embedded model's recipe (engine/train/recipe.py), on frames
[B, 3, T, H, W] in [-1, 1] as the VAE decodes them (raw, unclamped), against the styled targets.

The pixel losses measure each frame; the temporal ones the changes between frames (all pairs, and
the pairs across chunk boundaries alone); the chroma loss colour relative to brightness; the
sharpness loss the amount of edge in each decoded block, with a term that keeps the decoder's block
grid out of the picture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom_live.engine.layers.image_kernels import luma, sobel
from loom_live.host_bridge.wire.params import CHUNK_FRAMES, FIRST_CHUNK_FRAMES


def past_the_clamp(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y with its overshoot forgiven: where the target is pure black (-1) or pure white (1) and y goes
    further out, the decoder's clamp makes it exact, so it counts as x (no error, no gradient). The
    decoder can then keep black and white exactly, where a reconstruction error of one level would
    give a black pixel a loud hue (HSV saturation is unstable near black)."""
    over = ((x <= -1.0) & (y < x)) | ((x >= 1.0) & (y > x))
    return torch.where(over, x, y)


def pixel_loss(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """L1 on pixels and on their vertical and horizontal differences (keeps edges sharp); `y` is the
    raw (unclamped) output, its overshoot past pure black or white forgiven (`past_the_clamp`)."""
    y = past_the_clamp(y, x)
    def dy(t: torch.Tensor) -> torch.Tensor:
        return t[..., 1:, :] - t[..., :-1, :]

    def dx(t: torch.Tensor) -> torch.Tensor:
        return t[..., :, 1:] - t[..., :, :-1]

    return F.l1_loss(y, x) + F.l1_loss(dy(y), dy(x)) + F.l1_loss(dx(y), dx(x))


def temporal_loss(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """L1 between the output's and the target's frame-to-frame changes ([B, 3, T, H, W]). Each chunk's
    latent is predicted on its own, so nothing else ties a chunk's first frame to the last one before
    it: without this the output jumps at chunk boundaries although every frame is near its target."""
    y = past_the_clamp(y, x)
    return F.l1_loss(y[:, :, 1:] - y[:, :, :-1], x[:, :, 1:] - x[:, :, :-1])


def boundary_loss(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`temporal_loss` on the frame pairs that cross a chunk boundary alone. The temporal loss averages
    them with the three pairs inside each chunk, so a jump at every boundary weighs a quarter of it;
    the held-out boundary figure is exactly that jump over the mean change."""
    first = torch.arange(FIRST_CHUNK_FRAMES, y.shape[2], CHUNK_FRAMES, device=y.device)  # later chunks' first
    y = past_the_clamp(y, x)
    return F.l1_loss(y[:, :, first] - y[:, :, first - 1], x[:, :, first] - x[:, :, first - 1])


def sharpness_loss(y: torch.Tensor, x: torch.Tensor, patch: int = 8) -> torch.Tensor:
    """L1 between the output's and the target's edge energy per `patch` x `patch` block of each frame
    (the mean Sobel magnitude of the grey image, [B, 3, T, H, W] in [-1, 1]), plus `block_grid_loss`.
    Where a thin line's place is uncertain, the pixel and gradient L1 losses score a blur below a line
    drawn one pixel off (a line in the wrong place costs twice, a missing one once), so a regression
    model learns to leave lines out; this loss asks only for as much edge in each block as the target
    has, wherever it lies."""
    def energy(t: torch.Tensor) -> torch.Tensor:
        grey = F.pad(_grey(t), (1, 1, 1, 1), mode="replicate")
        g = F.conv2d(grey, sobel(t.device).to(t.dtype))
        return F.avg_pool2d(g.square().sum(1, keepdim=True).add(1e-6).sqrt(), patch)

    y = past_the_clamp(y, x).clamp(-1.0, 1.0)
    return F.l1_loss(energy(y), energy(x)) + block_grid_loss(y, x, patch)


def block_grid_loss(y: torch.Tensor, x: torch.Tensor, block: int = 8) -> torch.Tensor:
    """How much more the output's grey image changes across the decoder's `block`-pixel borders than
    the target's does (never less: a target with blocks of its own asks for nothing). Each latent pixel
    decodes to one block, so the cheapest edge energy a model can make is a blob per latent pixel, a
    grid the edge-energy loss alone would reward; `evaluate.block_grid` measures the same on the card."""
    def excess(t: torch.Tensor) -> torch.Tensor:
        grey = _grey(t)
        parts = []
        for d in (grey.diff(dim=-1).abs(), grey.diff(dim=-2).abs().transpose(-1, -2)):
            border = (torch.arange(d.shape[-1], device=d.device) + 1) % block == 0
            parts.append(d[..., border].mean(dim=(1, 2, 3)) - d[..., ~border].mean(dim=(1, 2, 3)))
        return torch.stack(parts).sum(0)  # per frame

    return F.relu(excess(y) - excess(x)).mean()


def _grey(t: torch.Tensor) -> torch.Tensor:
    """[B, 3, T, H, W] frames as grey images [B*T, 1, H, W]."""
    frames = t.transpose(1, 2).flatten(0, 1)
    return (frames * luma(t.device, t.dtype)).sum(1, keepdim=True)


def chroma_loss(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each pixel's chroma error (its channels' deviations from their mean) over the target's
    brightness ([B, 3, ...] in [-1, 1]). The gate's HSV saturation is (max - min) / max: on a dark
    pixel one or two levels of error in one channel make a loud colour, which an L1 or squared loss,
    blind to brightness, hardly sees."""
    y = past_the_clamp(y, x).clamp(-1.0, 1.0).add(1.0).mul(0.5)
    x = x.add(1.0).mul(0.5)
    cy, cx = y - y.mean(1, keepdim=True), x - x.mean(1, keepdim=True)
    return ((cy - cx).abs() / (x.amax(1, keepdim=True) + 0.03)).mean()
