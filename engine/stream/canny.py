"""Canny edges on the compute device, step for step as OpenCV's `cv2.Canny` draws them.

The VACE edges source runs once per chunk inside the stream. On the CPU, OpenCV needs the frames on
the host: a blocking device-to-host copy that waits for every kernel queued before it and so drains
the queue the GPU works from, then a few milliseconds of host work with the GPU idle. Done here in
tensor operations, the edges are queued like the rest of the chunk and nothing waits.

OpenCV's steps, as `canny` follows them: 3x3 Sobel derivatives of the uint8 grey image (border
replicated), the L1 magnitude |dx| + |dy|; non-maximum suppression along the gradient quantised to
four directions with OpenCV's fixed-point tangent test and its strict/non-strict comparisons, with
zero magnitude outside the image; a candidate above the low threshold, an edge above the high one;
hysteresis: every candidate 8-connected to an edge through candidates becomes one. OpenCV follows
chains to their end; here each hysteresis step reaches one pixel further, so `steps=None` runs until
nothing changes (exactly OpenCV's result) and a number bounds it without reading anything back (the
device path: chains longer than that from their nearest strong pixel stop there). On CUDA the bounded
steps can run compiled (`fused`): each step one fused kernel, where the eager pooling and product are two
slow ones and the steps are most of the edges' GPU time.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

from loom_live.engine.layers.image_kernels import sobel

SHIFT = 15  # OpenCV's fixed-point scale for the direction test
TAN_22_5 = int(0.4142135623730950488016887242097 * (1 << SHIFT) + 0.5)
DEVICE_STEPS = 64  # hysteresis steps on the device (no read-back to test for the end)
FUSED_STEPS = 8  # steps per compiled call: Inductor's compile time grows with the unrolled steps


def canny(grey: torch.Tensor, low: float, high: float, steps: int | None = None, fused: bool = False) -> torch.Tensor:
    """Edges of uint8 grey images [N, H, W] (any integer or float dtype holding 0..255): bool [N, H, W].

    `low`, `high`: OpenCV's thresholds on the L1 gradient magnitude (floored, as OpenCV does).
    `steps`: hysteresis steps; None: until no candidate joins (as OpenCV).
    `fused`: bounded steps on CUDA through torch.compile (needs triton); the same edges."""
    if grey.dim() != 3:
        raise ValueError(f"canny: expected grey images [N, H, W], got {tuple(grey.shape)}")
    dx, dy = _sobel(grey.float()[:, None])
    mag = dx.abs() + dy.abs()
    candidate = _local_max(mag, dx, dy) & (mag > float(int(low)))
    # 0/1 masks as numbers (half on a GPU), so each hysteresis step is a pooling and a product
    kind = torch.float16 if grey.is_cuda else torch.float32
    allowed = candidate.to(kind)
    edges = allowed * (mag > float(int(high)))
    if steps is not None:
        if fused and grey.is_cuda:
            for _ in range(steps // FUSED_STEPS):
                edges = _grow_compiled()(edges, allowed, FUSED_STEPS)
            steps %= FUSED_STEPS
        return _grow(edges, allowed, steps)[:, 0] > 0
    while not torch.equal(grown := allowed * F.max_pool2d(edges, 3, 1, 1), edges):
        edges = grown
    return edges[:, 0] > 0


def _grow(edges: torch.Tensor, allowed: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` hysteresis steps: each makes an edge of every candidate next to one."""
    for _ in range(steps):
        edges = allowed * F.max_pool2d(edges, 3, 1, 1)
    return edges


@cache
def _grow_compiled() -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    return torch.compile(_grow, fullgraph=True, dynamic=False)


def _sobel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenCV's 3x3 Sobel dx, dy with the border replicated; exact integers in float32."""
    d = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), sobel(x.device))
    return d[:, :1], d[:, 1:]


def _local_max(mag: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """OpenCV's non-maximum suppression: the magnitude beats its two neighbours along the gradient."""
    p = F.pad(mag, (1, 1, 1, 1))  # zero magnitude outside the image

    def at(dr: int, dc: int) -> torch.Tensor:
        h, w = mag.shape[-2:]
        return p[..., 1 + dr:1 + dr + h, 1 + dc:1 + dc + w]

    xs, ys = dx.abs().int(), dy.abs().int()
    tg22 = xs * TAN_22_5
    ys = ys << SHIFT
    tg67 = tg22 + (xs << (SHIFT + 1))
    horizontal = ys < tg22
    vertical = ~horizontal & (ys > tg67)
    diagonal = ~horizontal & ~vertical
    same_sign = (dx * dy) >= 0  # OpenCV: s = (dx ^ dy) < 0 ? -1 : 1
    # s = 1: previous row at x - 1 and next row at x + 1; s = -1: previous row at x + 1, next at x - 1
    diag = torch.where(same_sign, (mag > at(-1, -1)) & (mag > at(1, 1)), (mag > at(-1, 1)) & (mag > at(1, -1)))
    return (horizontal & (mag > at(0, -1)) & (mag >= at(0, 1))) \
        | (vertical & (mag > at(-1, 0)) & (mag >= at(1, 0))) \
        | (diagonal & diag)
