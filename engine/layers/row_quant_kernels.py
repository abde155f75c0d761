"""One-pass FP8 row quantisation (Triton) for the FP8 DiT's activations, plain or after the GELU or a norm.

Why: every FP8 layer quantises its input per row (scale = the row's largest magnitude / 448), which
needs the row's maximum before any element can be scaled. Inductor compiles such a reduction over a
long row (5120 or 13824 numbers in the 14B) as a loop that reads the row twice, once for the maximum
and once to scale and cast, and the norms that feed FP8 layers read it a third time for their mean
and variance. Here one program holds a whole row in registers: the activation is read once and the
e4m3 row and its scale written once. What each form computes is what `fp8_linear`'s compiled
functions compute (`quantize_rows`, `quantize_gelu_rows`, and the norms of `wan_dit_ops` rounded to
the activation's dtype before quantising), up to float32 rounding in the GELU and the norm.

Rows longer than `MAX_ROW` do not fit one program: `fits` says so, and the caller keeps the compiled
path for them. `to_fp8=False` returns the scaled float32 values before the cast (the tests' view on
a CPU, where Triton's interpreter does not round to e4m3 as the GPU does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the kernel's constants (Triton reads module globals only as constexprs)
FP8_MAX = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value
MIN_AMAX = tl.constexpr(1e-12)  # as fp8_linear: an all-zero row gets a tiny scale instead of 0/0
GELU_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi), GELU's tanh form
MAX_ROW = 16384  # numbers a program holds in registers (16 warps: 32 a thread)

PLAIN, GELU, NORM_MODULATE, NORM_AFFINE = 0, 1, 2, 3


@triton.jit
def _rows_kernel(x_ptr, out_ptr, scale_out_ptr, a_ptr, b_ptr, cols, rows_per_mod, eps,
                 MODE: tl.constexpr, TO_FP8: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    x = tl.load(x_ptr + row * cols + offs, mask=mask, other=0.0).to(tl.float32)
    if MODE == 1:  # GELU(tanh), in float32; tanh(u) = 1 - 2 / (exp(2u) + 1)
        u = GELU_C * (x + 0.044715 * x * x * x)
        x = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    if MODE >= 2:  # LayerNorm in float32, then modulation or the affine parameters, then x's dtype
        mean = tl.sum(x, axis=0) / cols
        centred = tl.where(mask, x - mean, 0.0)
        h = centred * tl.rsqrt(tl.sum(centred * centred, axis=0) / cols + eps)
        if MODE == 2:  # x * (1 + scale) + shift, one shift/scale row per latent frame
            mod = (row // rows_per_mod) * cols
            shift = tl.load(a_ptr + mod + offs, mask=mask, other=0.0).to(tl.float32)
            scale = tl.load(b_ptr + mod + offs, mask=mask, other=0.0).to(tl.float32)
            h = h * (1.0 + scale) + shift
        else:
            weight = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            bias = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            h = h * weight + bias
        x = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0)
    s = tl.maximum(amax, MIN_AMAX) / FP8_MAX
    q = tl.minimum(tl.maximum(x / s, -FP8_MAX), FP8_MAX)
    if TO_FP8:
        tl.store(out_ptr + row * cols + offs, q.to(tl.float8e4nv), mask=mask)
    else:
        tl.store(out_ptr + row * cols + offs, q, mask=mask)
    tl.store(scale_out_ptr + row, s)


def fits(cols: int) -> bool:
    """Whether a row of `cols` numbers fits one program (longer rows keep the compiled path)."""
    return cols <= MAX_ROW


def _launch(x: torch.Tensor, mode: int, a: torch.Tensor | None = None, b: torch.Tensor | None = None,
            rows_per_mod: int = 1, eps: float = 0.0, to_fp8: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    cols = x.shape[-1]
    if not fits(cols):
        raise ValueError(f"row_quant_kernels: rows of {cols} numbers; at most {MAX_ROW} fit one program")
    rows = x.reshape(-1, cols).contiguous()
    out = torch.empty(rows.shape, device=x.device, dtype=torch.float8_e4m3fn if to_fp8 else torch.float32)
    scale = torch.empty((rows.shape[0], 1), device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(cols)
    _rows_kernel[(rows.shape[0],)](rows, out, scale, rows if a is None else a, rows if b is None else b, cols,
                                   rows_per_mod, eps, MODE=mode, TO_FP8=to_fp8, BLOCK=block,
                                   num_warps=min(16, max(4, block // 1024)))
    return out, scale


def quantize_rows(x: torch.Tensor, to_fp8: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, 1] float32), as `fp8_linear.quantize_rows`."""
    return _launch(x, PLAIN, to_fp8=to_fp8)


def quantize_gelu_rows(x: torch.Tensor, to_fp8: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of GELU(tanh) of x, the GELU in float32, as `fp8_linear.quantize_gelu_rows`."""
    return _launch(x, GELU, to_fp8=to_fp8)


def norm_modulate_rows(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                       to_fp8: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `wan_dit_ops.norm_modulate(x, shift, scale, eps)` quantised: x [B, L, C], shift and scale
    [B, F, C] (one row per latent frame of L / F tokens)."""
    frames, cols = shift.shape[1], x.shape[-1]
    mods = (shift.reshape(-1, cols).contiguous(), scale.reshape(-1, cols).contiguous())
    return _launch(x, NORM_MODULATE, *mods, rows_per_mod=x.shape[1] // frames, eps=eps, to_fp8=to_fp8)


def affine_norm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                     to_fp8: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of `wan_dit_ops.affine_norm(x, weight, bias, eps)` quantised."""
    return _launch(x, NORM_AFFINE, weight.contiguous(), bias.contiguous(), eps=eps, to_fp8=to_fp8)
