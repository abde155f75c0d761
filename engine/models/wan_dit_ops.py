"""The elementwise steps of a Wan DiT block, as pure functions that can be fused.

Between its matrix products a block runs float32 LayerNorms, per-frame modulation, gated
residuals, RMS norms on q and k, and RoPE on q and k. Run eagerly, each of these is a chain of
separate full passes over [B, L, dim] activations (casts, means, multiplies, adds). Once CUDA
graphs remove the launch overhead, those memory-bound chains are a large share of the model's GPU
time (see docs/performance.md).

`BlockOps.eager()` is the plain-PyTorch reference. `BlockOps.compiled()` passes the same functions
through `torch.compile`, so each chain becomes one or two fused kernels. The matrix products and
attention stay with cuBLAS and the attention kernels; the FFN's GELU goes into its first matmul's
cuBLASLt epilogue instead. The KV cache's own tensor functions (RoPE, sink scores and writes) ride
along as `CacheOps`. The DiT switches between the two with `WanDiT.fuse_elementwise()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from loom_live.engine.cache.kv_cache import EAGER_CACHE_OPS, CacheOps, merge_sinks, sink_similarity
from loom_live.engine.cache.sink_write_kernel import masked_merge
from loom_live.engine.graphs.saved_compiles import SavedCompile
from loom_live.engine.layers.attention import attention, merge_partials, split_attention
from loom_live.engine.layers.rope import rotate


def layer_norm_f32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without affine parameters, computed and returned in float32."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift, per latent frame: x [B, L, dim], shift/scale [B, Fm, dim]."""
    frames = shift.shape[1]
    return (x.unflatten(1, (frames, -1)) * (1 + scale[:, :, None]) + shift[:, :, None]).flatten(1, 2)


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """The adaLN input of attention, FFN and head: modulate(LayerNorm(x)), back in x's dtype."""
    return modulate(layer_norm_f32(x, eps), shift, scale).to(x.dtype)


def affine_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with affine parameters (the cross-attention's norm3), in float32, back in x's dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + y * gate per latent frame, accumulated in float32, back in x's dtype."""
    frames = gate.shape[1]
    out = x.float() + (y.float().unflatten(1, (frames, -1)) * gate[:, :, None]).flatten(1, 2)
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Wan's RMSNorm over the last dimension (all heads together)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The FFN's first half: GELU(tanh) of x W^T + b."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def linear_gelu_epilogue(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`linear_gelu` as one cuBLASLt matmul whose epilogue applies the GELU(tanh) before the only write
    (unfused, the [tokens, ffn_dim] activation is written, read and written again). CUDA only; elsewhere
    the plain pair."""
    if not x.is_cuda:
        return linear_gelu(x, weight, bias)
    out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class BlockOps:
    """The set of elementwise functions a DiT uses; eager or compiled, same signatures."""

    norm_modulate: Callable[..., torch.Tensor]
    affine_norm: Callable[..., torch.Tensor]
    gated_residual: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    cache: CacheOps  # RoPE on q and k, the sink scores and writes, the window's attention (engine/cache/kv_cache.py)
    linear_gelu: Callable[..., torch.Tensor]
    fused: bool
    quantized_norms: bool = False  # norm_modulate and affine_norm return FP8 rows (engine/models/fp8_linear.py)

    @classmethod
    def eager(cls, attention_splits: int = 1) -> BlockOps:
        """The plain functions; `attention_splits` > 1 attends over the window's keys in that many parts
        (`split_attention`)."""
        cache = EAGER_CACHE_OPS if attention_splits == 1 else CacheOps(attend=_window_attention(attention_splits))
        return cls(norm_modulate, affine_norm, gated_residual, rms_norm, cache, linear_gelu, fused=False)

    @classmethod
    def compiled(cls, gelu_epilogue: bool = True, attention_splits: int = 1,
                 masked_sink_merge: bool = False, saved: Path | None = None, build_saved: bool = True) -> BlockOps:
        """The same functions through torch.compile (Inductor; Triton on CUDA, C++ on a CPU), and the
        FFN's first matmul with its GELU as the matmul's epilogue (`gelu_epilogue`; which kernel
        cuBLASLt picks with it, and so whether it pays, depends on the token count); with
        `attention_splits` > 1 the window's attention in parts, their merge compiled; with
        `masked_sink_merge`, on CUDA the sink merge writes only the slots it replaces
        (engine/cache/sink_write_kernel.py).

        Shapes start static; a second shape (another batch or chunk length) recompiles once with
        dynamic sizes instead of piling up specialisations. With a `saved` folder each function is
        loaded from there whole per argument signature (static shapes) instead of traced again, and with
        `build_saved` a signature not there yet is compiled whole and kept there (`SavedCompile`; without,
        it compiles as with no folder). Compilation happens on first
        use, so a CUDA-graph capture must follow an eager warm-up of the same shapes (the DiT graphs do).
        """

        def fuse(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            plain = torch.compile(fn, fullgraph=True)
            if saved is not None:
                plain = SavedCompile(fn, saved, f"dit.{fn.__name__}", build=build_saved, plain=plain)
            return partial(_with_unit_strides, plain)

        merge = masked_merge(fuse(merge_sinks)) if masked_sink_merge else fuse(merge_sinks)
        cache = CacheOps(fuse(rotate), fuse(sink_similarity), merge, _window_attention(attention_splits, fuse))
        return cls(fuse(norm_modulate), fuse(affine_norm), fuse(gated_residual), fuse(rms_norm), cache,
                   linear_gelu_epilogue if gelu_epilogue else linear_gelu, fused=True)


def _with_unit_strides(fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
    """`fn` on its arguments with each size-1 dimension's stride set as if contiguous with the next: such a
    stride addresses no other memory, but the compiled code is keyed on every stride, and a batch of one
    gives it a different one at each call site (a chunk's length, the head against the blocks)."""
    return fn(*(unit_strides(a) if isinstance(a, torch.Tensor) else a for a in args))


def unit_strides(t: torch.Tensor) -> torch.Tensor:
    """`t` as a view whose size-1 dimensions have the stride of a contiguous layout over the dimensions after
    them (the same memory; `t` itself where they have it already)."""
    sizes, strides = t.shape, list(t.stride())
    after = 1
    for i in range(t.dim() - 1, -1, -1):
        if sizes[i] == 1:
            strides[i] = after
        after = strides[i] * sizes[i]
    return t if strides == list(t.stride()) else t.as_strided(sizes, strides)


def _window_attention(splits: int, fuse: Callable[[Callable], Callable] | None = None) -> Callable[..., torch.Tensor]:
    """The window's attention: one call, or `splits` parts merged by `merge_partials` (through `fuse`)."""
    if splits < 1:
        raise ValueError(f"attention_splits: {splits} is not allowed; expected 1 (one call) or more parts")
    if splits == 1:
        return attention
    return partial(split_attention, splits=splits, merge=merge_partials if fuse is None else fuse(merge_partials))


EAGER_OPS = BlockOps.eager()
