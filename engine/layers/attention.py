"""Multi-head attention on [batch, tokens, heads, head_dim] tensors.

One place decides the kernel: flash-attn when it is installed and the call allows it (CUDA,
half precision, no mask), otherwise torch's scaled_dot_product_attention, which itself picks
the flash / cuDNN / memory-efficient kernels on a GPU. flash-attn is never required.

bfloat16 on a CPU is the exception: torch's fused CPU kernel is no faster there than in float32,
while two bfloat16 matrix products (oneDNN's) around a softmax that accumulates in float32 are
several times faster at the embedded model's shapes. The scores are rounded to bfloat16 once, so
the error is a few times the fused kernel's, still bfloat16 noise in the frames (docs/performance.md).

Split keys: a streaming chunk has few queries (one latent frame's tokens) against a window several
frames long. With few heads (the 1.3B's 12), the attention kernel's grid of query tiles times heads
leaves much of a large GPU idle in its last wave, while each tile walks the whole window.
`split_attention` attends over S equal parts of the keys as S batch entries of one call (the parts
are views of the cache, the queries are repeated), and merges the partial results exactly with
their log-sum-exps: the result is the same softmax, rounded differently.

Wide heads: the Wan VAE's mid-block attention has one head of 384 channels, wider than the flash and
cuDNN kernels take (256), so torch falls back to its memory-efficient kernel, which runs these shapes
far below the tensor cores' rate. `matmul_attention` is the same attention as two matrix products
(scores accumulated and kept in float32) around a float32 softmax.
"""

from __future__ import annotations

from collections.abc import Callable

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


def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v as two matrix products: q/k/v [N, L, D]; returns [N, Lq, D]. The scores
    are float32 (bf16/fp16 products accumulated and written in float32 on CUDA), the probabilities are
    rounded to v's dtype for the second product, as the fused kernels do."""
    scale = q.shape[-1] ** -0.5
    if q.is_cuda and q.dtype in HALF_DTYPES:
        scores = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    else:
        scores = torch.bmm(q.float(), k.float().transpose(1, 2))
    return torch.bmm(torch.softmax(scores * scale, dim=-1).to(v.dtype), v)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and the log-sum-exp of each query's scaled scores (natural log): q/k/v [B, H, L, D];
    returns out [B, H, Lq, D] and lse [B, H, Lq] in float32. CUDA: cuDNN's kernel in half precision
    (the one torch picks for these calls without a mask), the memory-efficient one otherwise."""
    lq = q.shape[2]
    if not q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    elif q.dtype in HALF_DTYPES:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    else:  # its log-sum-exps are padded along the queries
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[:2]
    return out, lse.flatten(2)[..., :lq].float()


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Attention over a whole key set from attention over its parts: out [B, S, H, Lq, D] and lse
    [B, S, H, Lq] of the S parts; returns [B, H, Lq, D]. Each part's result is weighted by the share
    of the softmax mass its keys hold, exp(lse_s) / sum exp(lse), computed in float32."""
    weight = torch.softmax(lse.float(), dim=1)
    return (out.float() * weight[..., None]).sum(1).to(out.dtype)


Merge = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def split_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *, splits: int,
    merge: Merge = merge_partials,
) -> torch.Tensor:
    """`attention` with the keys split into `splits` equal parts attended in one batched call and merged
    (`merge`: `merge_partials`, or a compiled copy of it). Same arguments and result as `attention`.

    The plain call instead where a split cannot help or is not defined here: one part, keys that do not
    split evenly, a mask (a window still filling), or autograd (training: the merge needs no gradient
    through the log-sum-exps, which the kernels do not give)."""
    b, lk = k.shape[:2]
    if splits == 1 or lk % splits or mask is not None or torch.is_grad_enabled():
        return attention(q, k, v, mask)
    parts = (b * splits, lk // splits, *k.shape[2:])
    ks, vs = k.reshape(parts), v.reshape(parts)  # views of a contiguous cache
    qs = q[:, None].expand(b, splits, *q.shape[1:]).flatten(0, 1)
    out, lse = attention_lse(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2))
    merged = merge(out.unflatten(0, (b, splits)), lse.unflatten(0, (b, splits)))
    return merged.transpose(1, 2)
