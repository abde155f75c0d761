"""The one-pass Triton row quantisation (model.fp8_quantize=triton) against the compiled functions it
replaces: in Triton's interpreter on a CPU (where triton is installed; its casts to bf16 and e4m3
truncate, so the e4m3 cast is left out and the norms' bf16 rounding checked to one truncation), and on
a GPU as the session runs it (gpu marker); and the choice between the kernels and the compiled path."""

from __future__ import annotations

import copy
import sys
import textwrap

import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.models import fp8_linear
from loom_live.engine.models.fp8_linear import convert_dit_to_fp8, quantize_gelu_rows, quantize_rows
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.engine.models.wan_dit_ops import affine_norm, norm_modulate
from tests.triton_child import run_triton

# The four forms in the interpreter, each against the reference's scaled values before the e4m3 cast;
# prints one line per form: name, the largest difference in e4m3 units, the largest relative scale error.
INTERPRETED = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from loom_live.engine.layers import row_quant_kernels as k
    from loom_live.engine.models.wan_dit_ops import affine_norm, norm_modulate

    def scaled(h):
        h = h.float().reshape(-1, h.shape[-1])
        s = h.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
        return (h / s).clamp(-448.0, 448.0), s

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 12, 200, generator=g) * 3).to(torch.bfloat16)
    x[0, 5] = 0  # an all-zero row: the tiny scale, no NaN
    shift, scale = torch.randn(2, 3, 200, generator=g), torch.randn(2, 3, 200, generator=g) * 0.2
    weight, bias = torch.randn(200, generator=g), torch.randn(200, generator=g)
    rows = x.reshape(-1, 200)
    for name, got, ref in [
        ("plain", k.quantize_rows(rows, to_fp8=False), scaled(rows)),
        ("gelu", k.quantize_gelu_rows(rows, to_fp8=False), scaled(F.gelu(rows.float(), approximate="tanh"))),
        ("norm_modulate", k.norm_modulate_rows(x, shift, scale, 1e-6, to_fp8=False),
         scaled(norm_modulate(x, shift, scale, 1e-6))),
        ("affine_norm", k.affine_norm_rows(x, weight, bias, 1e-6, to_fp8=False),
         scaled(affine_norm(x, weight, bias, 1e-6))),
    ]:
        assert torch.isfinite(got[0]).all() and got[1].shape == ref[1].shape
        print(name, (got[0] - ref[0]).abs().max().item(), ((got[1] - ref[1]).abs() / ref[1]).max().item())
""")


def test_the_kernels_compute_what_the_compiled_functions_compute_in_the_interpreter():
    lines = run_triton(INTERPRETED, interpret=True, timeout=240)
    found = {name: (float(d), float(s)) for name, d, s in (line.split() for line in lines)}
    assert found["plain"] == (0.0, 0.0), "the plain rows are the same numbers"
    assert found["gelu"][0] < 1e-3 and found["gelu"][1] < 1e-6, "float32 GELU: rounding only"
    for norm in ("norm_modulate", "affine_norm"):  # one bf16 step (the interpreter truncates) of 448
        d, s = found[norm]
        assert d <= 448 * 2.0**-7 + 1e-3 and s <= 2.0**-7, (norm, d, s)


def test_rows_that_fit_take_the_kernel_longer_ones_the_fallback():
    seen = []
    run = fp8_linear._where_rows_fit(lambda x: seen.append("kernel"), lambda x: seen.append("fallback"),
                                     lambda cols: cols <= 16)
    run(torch.zeros(3, 16))
    run(torch.zeros(3, 17))
    assert seen == ["kernel", "fallback"]


def test_the_setting_is_checked_and_the_emulation_refuses_the_kernels():
    assert load_config("tiny-random").model.fp8_quantize == "auto"
    with pytest.raises(ValueError, match="fp8_quantize"):
        load_config("tiny-random", ["model.fp8_quantize=cuda"])
    model = WanDiT(DIT_PRESETS["tiny"]).eval()
    with pytest.raises(ValueError, match="fp8_quantize: 'triton' runs on a CUDA GPU"):
        convert_dit_to_fp8(model, emulate=True, kernels="triton")
    with pytest.raises(ValueError, match="expected one of auto, compiled, triton"):
        convert_dit_to_fp8(model, emulate=True, kernels="fast")
    assert convert_dit_to_fp8(model, emulate=True)  # auto: the emulation quantises with torch


def test_auto_takes_the_compiled_quantisation_where_triton_is_missing_and_triton_says_so(monkeypatch):
    import loom_live.engine.layers as layers

    monkeypatch.setitem(sys.modules, "loom_live.engine.layers.row_quant_kernels", None)  # its import fails
    monkeypatch.delattr(layers, "row_quant_kernels", raising=False)  # (and an earlier import is forgotten)
    assert fp8_linear._row_kernels("auto", emulate=False) is None
    with pytest.raises(ValueError, match="'triton' needs the triton package"):
        fp8_linear._row_kernels("triton", emulate=False)


@pytest.mark.gpu
@pytest.mark.parametrize("cols", [1536, 5120, 13824])
def test_cuda_kernels_give_the_compiled_rows(cols):
    """The 1.3B's and 14B's row lengths (13824: the 14B's FFN) over one latent frame's 1560 tokens: the
    e4m3 rows and scales of the kernels and of the functions they replace, dequantised, agree to e4m3's
    step (a division or the GELU or a norm may round a value to the other side of a step now and then)."""
    from loom_live.engine.layers import row_quant_kernels as k

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    x = (torch.randn(1, 1560, cols, device=dev, generator=g) * 2).to(torch.bfloat16)
    shift, scale = torch.randn(1, 1, cols, device=dev, generator=g), torch.randn(1, 1, cols, device=dev,
                                                                                   generator=g) * 0.1
    weight, bias = torch.randn(cols, device=dev, generator=g), torch.randn(cols, device=dev, generator=g)
    rows = x.reshape(-1, cols)
    cases = [(k.quantize_rows(rows), quantize_rows(rows), 1e-4),
             (k.quantize_gelu_rows(rows), quantize_gelu_rows(rows), 1e-4),
             (k.norm_modulate_rows(x, shift, scale, 1e-6),
              quantize_rows(norm_modulate(x, shift, scale, 1e-6).reshape(-1, cols)), 1e-2),
             (k.affine_norm_rows(x, weight, bias, 1e-6),
              quantize_rows(affine_norm(x, weight, bias, 1e-6).reshape(-1, cols)), 1e-2)]
    for (q, s), (q_ref, s_ref), flips in cases:
        assert q.dtype == torch.float8_e4m3fn and q.shape == q_ref.shape and s.shape == s_ref.shape
        torch.testing.assert_close(s, s_ref, rtol=2.0**-7, atol=0)
        got, ref = q.float() * s, q_ref.float() * s_ref
        off = (got - ref).abs() > 2.0**-3 * ref.abs() + 1e-6 * s_ref
        assert off.float().mean().item() <= flips
        assert ((got - ref).abs() <= 2.0**-2 * ref.abs() + 2 * s_ref).all()


@pytest.mark.gpu
def test_cuda_fp8_dit_with_the_kernels_streams_like_the_compiled_quantisation():
    dev = torch.device("cuda")
    torch.manual_seed(9)
    with torch.device(dev):
        model = WanDiT(DIT_PRESETS["tiny"]).to(torch.bfloat16).eval()
    other = copy.deepcopy(model)
    for m in (model, other):  # the session's order: compiled block ops, then the conversion on them
        m.fuse_elementwise()
    convert_dit_to_fp8(model, compiled=True, kernels="triton")
    convert_dit_to_fp8(other, compiled=True)
    ctx = torch.randn(1, 8, 4096, device=dev)
    chunks = [torch.randn(1, 16, f, 8, 8, device=dev) for f in [2] + [1] * 6]
    outs = []
    with torch.inference_mode():
        for m in (model, other):
            cache, cross = m.new_cache(1, (8, 8), num_kv_cache=3, sink=1, refresh_at=5), m.cross_kv(ctx)
            t = torch.tensor([600.0], device=dev)
            outs.append(torch.cat([m.forward_stream(c, t, cache, cross) for c in chunks], 2).float())
    assert ((outs[0] - outs[1]).norm() / outs[1].norm()).item() < 0.01
