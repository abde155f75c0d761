"""FP8 (e4m3) matrix products for the DiT's transformer blocks, on Hopper/Ada GPUs.

Why: the blocks' linears carry most of the streaming forward's FLOPs (the rest is attention),
and an H100/H200 runs float8 tensor-core products at twice the bf16 rate. The cost is
precision: e4m3 keeps 3 mantissa bits, so every operand is rounded to within 2^-4 of its value
(relative; values far below their row's largest fall into e4m3's subnormals and lose more).
docs/performance.md states what that does to the flow prediction (benchmarks/fp8_quality.py
measures it).

Scheme (W8A8, dynamic activations):
- weights: quantised once at conversion, one float32 scale per output channel (row of the
  [out, in] weight), stored as float8_e4m3fn (half the bf16 weight memory);
- activations: quantised per token (row) on every call, scale = row amax / 448. That pass reads the
  whole activation once more, so the conversion runs as few as it can: q, k and v, which read the same
  input, become one product over their stacked weights (one quantisation instead of three); the FFN's
  GELU moves into its second linear's quantisation (one pass instead of a GELU pass and a
  quantisation pass); and the block's norms before q/k/v, the cross-attention's q and the FFN hand
  their layers rows already quantised (`QuantizedRows`: the norm and the quantisation as one pass,
  with no full-precision copy of the normalised activation written and read back);
- product: `torch._scaled_mm` with row-wise scales, bias fused in the output dtype.
Both operands go through the same `quantize_rows`, and the CPU emulation
(`scaled_mm_emulated`, used by tests and smoke runs) computes what the GPU kernel computes:
exact fp8*fp8 products accumulated in float32, times scale_a[m] * scale_b[n], plus bias,
rounded once to the output dtype.

The `torch._scaled_mm` contract relied on, read from the sources, not guessed: the torch 2.11.0
(cu130 wheel) and 2.13.0 `torch/_C/_VariableFunctions.pyi` (the same positional signature
mat1, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum) and
`torch/_meta_registrations.py::_check_scaled_mm_sizes` (the same layout, size and scale checks), the error strings of
2.11's libtorch_cuda.so, and pytorch's `aten/src/ATen/native/cuda/ScaledBlas.cpp::_scaled_mm_out_cuda`:
- CUDA capability >= 8.9 (Ada) or 9.0 (Hopper); both matrices 2-D float8;
- mat1 row-major [M, K], mat2 column-major [K, N] (Hopper cuBLASLt takes only "TN"): we pass
  the stored row-major [N, K] weight transposed, a free view;
- K and N multiples of 16 (M is free);
- row-wise scaling: scale_a float32 [M, 1] and scale_b float32 [1, N], both contiguous;
- bias [N] must be bfloat16 for bf16 output, float16 for fp16 output, and is refused with a
  float32 output; 2.11's row-wise kernels also output only bf16/fp16 ("Only bf16 and fp16 high
  precision output types are supported for row-wise scaling"); hence the CUDA path needs a
  bf16/fp16 model;
- row-wise scaling on sm_89 went through CUTLASS kernels that were missing in some builds
  (pytorch issue 130359), so conversion probes the kernel once and fails with a clear message.
Conversion must come after loading and after any `.to(dtype)`: `Module.to` would cast the
float8 buffers as if they were plain numbers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from loom_live.engine.models.wan_dit_ops import BlockOps, affine_norm, norm_modulate

if TYPE_CHECKING:
    from loom_live.engine.models.wan_dit import WanDiT

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: the largest finite e4m3fn value
MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale instead of 0/0
MIN_CAPABILITY = (8, 9)  # Ada; Hopper is 9.0
ALIGNMENT = 16  # _scaled_mm: K and N must be multiples of 16
CUDA_OUT_DTYPES = (torch.bfloat16, torch.float16)  # dtypes _scaled_mm can fuse the bias into

# The linears converted inside every WanBlock. cross_attn.k/v stay in the model dtype: they run
# once per prompt on the text (CrossKV), never on the per-chunk hot path.
BLOCK_LINEARS = (
    "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
    "cross_attn.q", "cross_attn.o",
    "ffn.0", "ffn.2",
)

Quantized = tuple[torch.Tensor, torch.Tensor]  # (e4m3 rows [M, K], float32 scales [M, 1])
Quantize = Callable[[torch.Tensor], Quantized]
QUANTIZE_KERNELS = ("auto", "compiled", "triton")  # how activations are quantised: model.fp8_quantize


class QuantizedRows(NamedTuple):
    """An activation already quantised by `quantize_rows` (data [M, K] e4m3, scale [M, 1] float32), with
    the shape and dtype of the activation it stands for: what an `FP8Linear` takes instead of it."""

    data: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] float32) with x ~= q * scale.

    Each row is scaled so that its largest magnitude lands on 448; the clamp guards the last
    ulp (a cast above the range gives NaN on some torch versions instead of saturating).
    """
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_gelu_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of GELU(tanh) of x, the GELU taken in float32: the FFN's activation and its second
    linear's quantisation as one pass over the [tokens, ffn_dim] activation when compiled."""
    return quantize_rows(F.gelu(x.float(), approximate="tanh"))


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values that (q, scale) from `quantize_rows` stand for."""
    return q.float() * scale


def scaled_mm_emulated(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """What row-wise `torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=...)` computes, on
    any device: fp8 products (exact in float32) summed in float32, scaled, bias added, one rounding."""
    out = (a.float() @ b.float()) * scale_a * scale_b
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


class FP8Linear(nn.Module):
    """A linear layer whose weight is stored in e4m3 with a per-output-channel scale.

    `emulate=True` computes the same numbers without `torch._scaled_mm` (CPU tests, smoke runs);
    it is not a speed path.
    """

    def __init__(
        self,
        weight_fp8: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        emulate: bool = False,
        quantize: Quantize = quantize_rows,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_fp8.shape
        self.register_buffer("weight", weight_fp8)  # [out, in] float8_e4m3fn, row-major
        self.register_buffer("weight_scale", weight_scale)  # [1, out] float32
        self.register_buffer("bias", bias)  # [out] in the model dtype, or None
        self.emulate = emulate
        self.quantize = quantize

    @classmethod
    def from_linear(cls, linear: nn.Linear, emulate: bool = False, quantize: Quantize = quantize_rows) -> FP8Linear:
        return cls.from_weight(linear.weight, linear.bias, emulate=emulate, quantize=quantize)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, emulate: bool = False,
                    quantize: Quantize = quantize_rows) -> FP8Linear:
        """The layer for a full-precision weight [out, in] and bias [out] (copied, not kept)."""
        out_f, in_f = weight.shape
        if in_f % ALIGNMENT or out_f % ALIGNMENT:
            raise ValueError(f"FP8 linear: weight [{out_f}, {in_f}] has a side that is not a multiple of "
                             f"{ALIGNMENT}, which torch._scaled_mm requires")
        q, scale = quantize_rows(weight.detach())
        bias = None if bias is None else bias.detach().clone()
        return cls(q, scale.reshape(1, out_f).contiguous(), bias, emulate=emulate, quantize=quantize)

    def rows(self, start: int, stop: int) -> FP8Linear:
        """The layer of output channels start..stop, sharing this one's storage (row scales make each
        output channel's numbers independent of the others)."""
        bias = None if self.bias is None else self.bias[start:stop]
        return FP8Linear(self.weight[start:stop], self.weight_scale[:, start:stop], bias, self.emulate, self.quantize)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            a, scale_a, shape, dtype = x
        else:
            (a, scale_a), shape, dtype = self.quantize(x.reshape(-1, self.in_features)), x.shape, x.dtype
        b = self.weight.t()  # [in, out] column-major view, as _scaled_mm wants
        if self.emulate:
            y = scaled_mm_emulated(a, b, scale_a, self.weight_scale, self.bias, dtype)
        else:
            y = torch._scaled_mm(a, b, scale_a, self.weight_scale, bias=self.bias, out_dtype=dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, emulate={self.emulate}"


def quantizing_norms(ops: BlockOps, compiled: bool, rows: Any = None) -> BlockOps:
    """`ops` whose norm_modulate and affine_norm return `QuantizedRows` for the FP8 layers they feed: the
    norm and the quantisation as one function (compiled together when `compiled`; with `rows`, the
    `row_quant_kernels` module, its one-pass kernels where a row fits one), so the normalised activation
    is never written in full precision."""

    def quantizing(norm: Callable[..., torch.Tensor], kernel: str) -> Callable[..., QuantizedRows]:
        def norm_rows(x: torch.Tensor, *args: object) -> Quantized:
            h = norm(x, *args)
            return quantize_rows(h.reshape(-1, h.shape[-1]))

        fused = torch.compile(norm_rows, fullgraph=True) if compiled else norm_rows
        one_pass = fused if rows is None else _where_rows_fit(getattr(rows, kernel), fused, rows.fits)

        def run(x: torch.Tensor, *args: object) -> QuantizedRows:
            return QuantizedRows(*one_pass(x, *args), x.shape, x.dtype)

        return run

    return replace(ops, norm_modulate=quantizing(norm_modulate, "norm_modulate_rows"),
                   affine_norm=quantizing(affine_norm, "affine_norm_rows"), quantized_norms=True)


def _row_kernels(kernels: str, emulate: bool) -> Any:
    """The one-pass Triton kernels module for `kernels` "triton" (imported only then: it needs triton),
    None for "compiled"; "auto" is "triton" on a GPU where triton imports, else "compiled"."""
    if kernels not in QUANTIZE_KERNELS:
        raise ValueError(f"fp8_quantize: {kernels!r} is not allowed; expected one of {', '.join(QUANTIZE_KERNELS)}")
    if kernels == "triton" and emulate:
        raise ValueError("fp8_quantize: 'triton' runs on a CUDA GPU; the CPU emulation quantises with torch")
    if kernels == "compiled" or (kernels == "auto" and emulate):
        return None
    try:
        from loom_live.engine.layers import row_quant_kernels
    except ImportError as exc:
        if kernels == "auto":
            log.info("fp8_quantize auto: no triton here (%s); the compiled quantisation runs", exc)
            return None
        raise ValueError(f"fp8_quantize: 'triton' needs the triton package ({exc}; torch's CUDA builds bring "
                         "it); or use 'compiled'") from exc
    return row_quant_kernels


def _where_rows_fit(kernel: Callable[..., Quantized], fallback: Callable[..., Quantized],
                    fits: Callable[[int], bool]) -> Callable[..., Quantized]:
    """`kernel` for activations whose rows `fits` (one Triton program holds them), `fallback` for others."""

    def run(x: torch.Tensor, *args: object) -> Quantized:
        return (kernel if fits(x.shape[-1]) else fallback)(x, *args)

    return run


def check_fp8_device(device: torch.device | str) -> None:
    """Refuse a device that cannot run FP8 matmuls, naming it and what is allowed."""
    device = torch.device(device)
    allowed = "a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or newer)"
    if device.type != "cuda":
        raise ValueError(f"fp8_linear: device {str(device)!r} cannot run FP8 matmuls; allowed: {allowed}")
    if not torch.cuda.is_available():
        raise ValueError(f"fp8_linear: {str(device)!r} asked for, but no CUDA GPU is available; allowed: {allowed}")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        raise ValueError(f"fp8_linear: {torch.cuda.get_device_name(device)} ({device}) has compute capability "
                         f"{cap[0]}.{cap[1]}; allowed: {allowed}")


def _probe(device: torch.device, dtype: torch.dtype) -> None:
    """One tiny row-wise product, so a torch build without the kernel fails at load, not mid-stream."""
    linear = nn.Linear(ALIGNMENT, ALIGNMENT, device=device, dtype=dtype)
    try:
        FP8Linear.from_linear(linear)(torch.ones(1, ALIGNMENT, device=device, dtype=dtype))
    except RuntimeError as exc:
        raise ValueError(f"fp8_linear: torch {torch.__version__} on {torch.cuda.get_device_name(device)} cannot run "
                         f"row-wise FP8 torch._scaled_mm ({exc}); turn fp8_linear off") from exc


def convert_dit_to_fp8(model: WanDiT, emulate: bool = False, compiled: bool = False,
                       kernels: str = "auto") -> list[str]:
    """Replace the hot-path linears of every loaded WanBlock (`BLOCK_LINEARS`) by `FP8Linear`s,
    in place, after the weights are loaded; returns the converted module names.

    q, k and v become row slices of one layer whose product the block runs (one quantisation of
    their shared input); the FFN's GELU moves into its second linear's quantisation (`ffn.1` becomes
    the identity); the block's norms quantise for the layers after them (`quantizing_norms`, built
    from the ops the block has, so set those first: `WanDiT.fuse_elementwise` refuses to run after).
    Embeddings, head and the per-prompt cross-attention K/V projections stay as they are. Blocks left
    on the meta device (another pipeline rank's) are skipped. `compiled` runs the activation
    quantisation through torch.compile (one kernel instead of several eager passes); `kernels` "triton"
    runs it as `row_quant_kernels`' one-pass kernels instead wherever a row fits one (CUDA only), "auto"
    where triton is there, "compiled" the compiled (or eager) functions.
    """
    rows = _row_kernels(kernels, emulate)
    param = model.patch_embedding.weight
    if not emulate:
        check_fp8_device(param.device)
        if param.dtype not in CUDA_OUT_DTYPES:
            raise ValueError(f"fp8_linear: the model is {param.dtype}; the CUDA FP8 path needs bfloat16 or float16 "
                             "(torch._scaled_mm fuses the bias only into those outputs)")
        _probe(param.device, param.dtype)

    def fuse(fn: Quantize) -> Quantize:
        return torch.compile(fn, fullgraph=True) if compiled else fn

    quantize, quantize_gelu = fuse(quantize_rows), fuse(quantize_gelu_rows)
    if rows is not None:
        quantize = _where_rows_fit(rows.quantize_rows, quantize, rows.fits)
        quantize_gelu = _where_rows_fit(rows.quantize_gelu_rows, quantize_gelu, rows.fits)
    block_ops: dict[int, BlockOps] = {}  # one quantising set per set of ops (the blocks share one)
    names = []
    for i, block in enumerate(model.blocks):
        if block.modulation.is_meta:
            continue
        linears = {path: block.get_submodule(path) for path in BLOCK_LINEARS}
        for path, linear in linears.items():
            if type(linear) is not nn.Linear:
                raise ValueError(f"fp8_linear: blocks.{i}.{path} is a {type(linear).__name__}, not an nn.Linear "
                                 "(converted twice?)")
        if not (isinstance(block.ffn[1], nn.GELU) and block.ffn[1].approximate == "tanh"):
            raise ValueError(f"fp8_linear: blocks.{i}.ffn.1 is {block.ffn[1]}, not the GELU(tanh) the FP8 FFN "
                             "folds into its second linear")
        attn = block.self_attn
        dim = attn.q.out_features
        qkv = FP8Linear.from_weight(torch.cat([attn.q.weight, attn.k.weight, attn.v.weight]),
                                    torch.cat([attn.q.bias, attn.k.bias, attn.v.bias]), emulate, quantize)
        attn.q, attn.k, attn.v = (qkv.rows(j * dim, (j + 1) * dim) for j in range(3))
        attn.use_qkv_product(qkv, qkv.weight)
        attn.o = FP8Linear.from_linear(attn.o, emulate, quantize)
        cross = block.cross_attn
        cross.q, cross.o = (FP8Linear.from_linear(m, emulate, quantize) for m in (cross.q, cross.o))
        first, _, second = block.ffn
        block.ffn[0] = FP8Linear.from_linear(first, emulate, quantize)
        block.ffn[1] = nn.Identity()
        block.ffn[2] = FP8Linear.from_linear(second, emulate, quantize_gelu)
        if id(block.ops) not in block_ops:
            block_ops[id(block.ops)] = quantizing_norms(block.ops, compiled, rows)
        block.ops = block_ops[id(block.ops)]
        names += [f"blocks.{i}.{path}" for path in BLOCK_LINEARS]
    return names

