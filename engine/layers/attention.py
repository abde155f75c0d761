"""Multi-head attention on [batch, tokens, heads, head_dim] tensors.

One place decides the kernel: flash-attn when it is installed and the call allows it (CUDA,
half precision, no mask), otherwise torch's scaled_dot_product_attention, which itself picks
the flash / cuDNN / memory-efficient kernels on a GPU. flash-attn is never required.

bfloat16 on a CPU is the exception: torch's fused CPU kernel is no faster there than in float32,
while two bfloat16 matrix products (oneDNN's) around a softmax that accumulates in float32 are
several times faster at the embedded model's shapes. The scores are rounded to bfloat16 once, so
the error is a few times the fused kernel's, still bfloat16 noise in the frames (docs/performance.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional accelerator, used only when importable
    from flash_attn import flash_attn_func as _flash_attn_func
except ImportError:  # pragma: no cover - depends on the machine
    _flash_attn_func = None

HALF_DTYPES = (torch.float16, torch.bfloat16)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v; q [B, Lq, H, D], k/v [B, Lk, H, D]; mask broadcastable to
    [B, H, Lq, Lk], True where attention is allowed. Returns [B, Lq, H, D]."""
    if (
        _flash_attn_func is not None
        and mask is None
        and q.is_cuda
        and q.dtype in HALF_DTYPES
        and k.stride(-1) == 1
        and v.stride(-1) == 1
    ):
        return _flash_attn_func(q, k, v)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        return (scores.softmax(-1) @ v).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
