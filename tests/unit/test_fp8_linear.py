"""FP8 (e4m3) block linears: quantisation bounds, the emulated product, which layers convert,
device refusal, and loading before conversion. The CUDA kernel itself is checked by the gpu tests."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from loom_live.engine.config import load_config
from loom_live.engine.graphs.dit_steps import GraphedStreamForward
from loom_live.engine.models.fp8_linear import (
    BLOCK_LINEARS,
    FP8_DTYPE,
    FP8Linear,
    convert_dit_to_fp8,
    dequantize_rows,
    quantize_rows,
    scaled_mm_emulated,
)
from loom_live.engine.models.loading import load_models
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT, WanDiTConfig
from loom_live.engine.models.wan_dit_ops import EAGER_OPS, BlockOps

E4M3_HALF_STEP = 2.0**-4  # round-to-nearest with 3 mantissa bits: relative error <= 2^-4 for normal values
E4M3_MIN_NORMAL = 2.0**-6
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # subnormal spacing is 2^-9: absolute error <= 2^-10 (in scale units)
SMALL = WanDiTConfig(dim=32, ffn_dim=64, num_heads=2, num_layers=3, text_dim=16, text_len=8, freq_dim=16)


def _rows() -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(6, 256) * torch.tensor([1.0, 1e-3, 1e4, 1.0, 1.0, 0.0])[:, None]
    x[3, 7] = 500.0  # an outlier row: its small entries fall into e4m3's subnormal range
    return x


def test_quantize_rows_round_trip_within_the_e4m3_step():
    x = _rows()
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (6, 1)
    back = dequantize_rows(q, scale)
    assert torch.isfinite(back).all() and torch.equal(back[5], torch.zeros(256))  # all-zero row: no 0/0
    err, mag = (back - x).abs(), x.abs()
    normal = mag / scale >= E4M3_MIN_NORMAL
    assert normal[:5].float().mean() > 0.9 and not normal[3].all()  # both branches are exercised
    assert (err[normal] <= E4M3_HALF_STEP * mag[normal] * (1 + 1e-6)).all()
    slack = (E4M3_SUBNORMAL_HALF_STEP * scale).expand_as(x)
    assert (err[~normal] <= slack[~normal] * (1 + 1e-6)).all()
    # each row's largest magnitude sits on the top of the range, so no row wastes precision
    torch.testing.assert_close(back.abs().amax(1)[:5], x.abs().amax(1)[:5], rtol=1e-6, atol=0)


def test_emulated_product_is_dequantise_then_float32_matmul():
    torch.manual_seed(1)
    a, sa = quantize_rows(torch.randn(37, 64))  # M need not be a multiple of 16
    w, sw = quantize_rows(torch.randn(48, 64))
    bias = torch.randn(48)
    got = scaled_mm_emulated(a, w.t(), sa, sw.reshape(1, -1), bias, torch.float32)
    ref = dequantize_rows(a, sa) @ dequantize_rows(w, sw).t() + bias
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,n", [(128, 256), (512, 128)])
def test_emulated_fp8_linear_matches_float32_linear(k, n):
    """Each operand is within 2^-4 relative (+ half a subnormal step) of its value, so every output
    is within the bound summed below; on random data the relative error is ~3.6% (two e4m3 roundings)."""
    torch.manual_seed(2)
    linear, x = nn.Linear(k, n), torch.randn(3, 37, k)
    fp8 = FP8Linear.from_linear(linear, emulate=True)
    with torch.no_grad():
        ref, got = linear(x), fp8(x)
    assert got.shape == ref.shape == (3, 37, n) and got.dtype == torch.float32
    x2, w = x.reshape(-1, k).double(), linear.weight.detach().double()
    ex = E4M3_HALF_STEP * x2.abs() + E4M3_SUBNORMAL_HALF_STEP * quantize_rows(x2)[1]
    ew = E4M3_HALF_STEP * w.abs() + E4M3_SUBNORMAL_HALF_STEP * quantize_rows(w)[1]
    bound = ex @ w.abs().t() + x2.abs() @ ew.t() + ex @ ew.t() + 1e-5
    assert ((got - ref).reshape(-1, n).abs() <= bound).all()
    rel = ((got - ref).norm() / ref.norm()).item()
    cos = F.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    assert 0.01 < rel < 0.05 and cos > 0.998  # a real quantisation happened, and only that


def _linear_names(model: nn.Module, kind: type) -> set[str]:
    return {name for name, m in model.named_modules() if type(m) is kind}


def test_conversion_touches_exactly_the_block_hot_path_linears():
    torch.manual_seed(3)
    model = WanDiT(DIT_PRESETS["tiny"]).eval()
    before = _linear_names(model, nn.Linear)
    kept_params = {n: p for n, p in model.named_parameters() if ".cross_attn.k." in n or "blocks." not in n}
    names = convert_dit_to_fp8(model, emulate=True)
    expected = [f"blocks.{i}.{path}" for i in range(4) for path in BLOCK_LINEARS]
    assert names == expected and len(names) == 4 * 8
    assert _linear_names(model, FP8Linear) == set(expected)
    kept = before - set(expected)
    assert _linear_names(model, nn.Linear) == kept
    assert {n for n in kept if n.startswith("blocks.")} == {
        f"blocks.{i}.cross_attn.{p}" for i in range(4) for p in ("k", "v")
    }
    assert {"text_embedding.0", "time_embedding.2", "time_projection.1", "head.head"} <= kept
    after = dict(model.named_parameters())
    assert all(after[n] is p for n, p in kept_params.items())  # embeddings, head, cross k/v untouched
    block = model.blocks[0].self_attn.q
    assert block.weight.dtype == FP8_DTYPE and block.weight_scale.shape == (1, 128)
    for b in model.blocks:  # q, k and v run as one product over a weight they are slices of
        attn = b.self_attn
        assert attn._fused() is attn.qkv[0] and attn.qkv[0].weight.shape == (3 * 128, 128)
        assert attn.v.weight.data_ptr() == attn.qkv[0].weight[2 * 128:].data_ptr()
        assert isinstance(b.ffn[1], nn.Identity)  # the GELU is in ffn.2's quantisation
    with pytest.raises(ValueError, match=r"blocks\.0\.self_attn\.q is a FP8Linear.*converted twice"):
        convert_dit_to_fp8(model, emulate=True)


def test_cuda_path_refuses_the_cpu_with_what_is_allowed():
    model = WanDiT(SMALL)
    with pytest.raises(ValueError, match=r"device 'cpu' cannot run FP8 matmuls; allowed: .*capability >= 8\.9"):
        convert_dit_to_fp8(model)
    assert not _linear_names(model, FP8Linear)


def test_load_models_refuses_fp8_on_cpu_before_reading_weights(tmp_path):
    cfg = load_config("tiny-random", ["model.device=cpu", "model.fp8_linear=true",
                             f"model.checkpoint={tmp_path / 'absent.safetensors'}"])
    with pytest.raises(ValueError, match=r"fp8_linear: device 'cpu'"):  # not the missing-file error
        load_models(cfg)


def test_checkpoint_loads_before_conversion(tmp_path):
    """Conversion comes after loading: a checkpoint of the full-precision model loads as before, and
    converting the loaded model (all blocks, or one pipeline rank's) equals converting the original."""
    torch.manual_seed(4)
    ref = WanDiT(SMALL).eval()
    path = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    loaded = WanDiT.from_checkpoint(path, SMALL).eval()
    x, t, ctx = torch.randn(1, 16, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 3, 16)
    with torch.no_grad():
        full = ref(x, t, ctx)
        convert_dit_to_fp8(ref, emulate=True)
        convert_dit_to_fp8(loaded, emulate=True)
        got = loaded(x, t, ctx)
        torch.testing.assert_close(got, ref(x, t, ctx), rtol=1e-5, atol=1e-5)  # BLAS alignment noise only
    assert (got - full).norm() > 1e-3 * full.norm()  # and the converted model really is quantised
    rank = WanDiT.from_checkpoint(path, SMALL, blocks=range(1, 2))
    assert convert_dit_to_fp8(rank, emulate=True) == [f"blocks.1.{p}" for p in BLOCK_LINEARS]


def _tiny_stream(model: WanDiT, seed: int) -> torch.Tensor:
    """Four chunks of a tiny-model stream (the first two latents), their outputs concatenated."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, 8, 4096, generator=g)
    chunks = [torch.randn(1, 16, f, 8, 8, generator=g) for f in (2, 1, 1, 1)]
    with torch.no_grad():
        cache, cross = model.new_cache(1, (8, 8), num_kv_cache=3, sink=1, refresh_at=5), model.cross_kv(ctx)
        return torch.cat([model.forward_stream(c, torch.tensor([600.0]), cache, cross) for c in chunks], 2)


def test_streaming_forward_with_emulated_fp8_stays_close_to_float32():
    torch.manual_seed(5)
    ref = WanDiT(DIT_PRESETS["tiny"]).eval()
    fp8 = copy.deepcopy(ref)
    convert_dit_to_fp8(fp8, emulate=True)
    outs = [_tiny_stream(model, seed=6) for model in (ref, fp8)]
    rel = ((outs[1] - outs[0]).norm() / outs[0].norm()).item()
    assert 0 < rel < 0.03


def test_norms_that_quantise_for_their_layers_give_what_the_layers_quantising_give():
    """The blocks' norms hand their FP8 layers rows already quantised (one pass instead of two): the
    same numbers as the layers quantising the norms' output themselves."""
    torch.manual_seed(9)
    fused = WanDiT(DIT_PRESETS["tiny"]).eval()
    plain = copy.deepcopy(fused)
    for model in (fused, plain):
        convert_dit_to_fp8(model, emulate=True)
    assert all(b.ops.quantized_norms for b in fused.blocks)
    assert not fused.head.ops.quantized_norms  # the head's norm feeds a full-precision layer
    for b in plain.blocks:
        b.ops = EAGER_OPS
    torch.testing.assert_close(_tiny_stream(fused, seed=10), _tiny_stream(plain, seed=10), rtol=0, atol=0)
    with pytest.raises(ValueError, match="choose the ops before convert_dit_to_fp8"):
        fused.fuse_elementwise(BlockOps.eager())


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(1536, 1536), (1536, 8960), (8960, 1536)])
def test_cuda_scaled_mm_matches_the_emulation(k, n):
    """The 1.3B block shapes, 1560 tokens (one 480x832 latent frame): torch._scaled_mm and the
    emulation see the same fp8 operands and scales; they may differ by the float32 summation
    order and the final bf16 rounding."""
    dev = torch.device("cuda")
    torch.manual_seed(7)
    linear = nn.Linear(k, n, device=dev, dtype=torch.bfloat16)
    x = torch.randn(1, 1560, k, device=dev, dtype=torch.bfloat16)
    cuda = FP8Linear.from_linear(linear)
    emulated = FP8Linear.from_linear(linear, emulate=True)
    with torch.inference_mode():
        got, ref, exact = cuda(x).float(), emulated(x).float(), linear(x).float()
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=1e-3 * ref.abs().max().item())
    assert ((got - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["auto", "compiled"])
def test_cuda_fp8_dit_streams_under_graphs_like_the_emulation(kernels):
    dev = torch.device("cuda")
    torch.manual_seed(8)
    with torch.device(dev):
        model = WanDiT(DIT_PRESETS["tiny"]).to(torch.bfloat16).eval()
    emulated = copy.deepcopy(model)
    model.fuse_elementwise()  # the session's path: compiled block ops, then the conversion on them
    assert len(convert_dit_to_fp8(model, compiled=True, kernels=kernels)) == 32
    convert_dit_to_fp8(emulated, emulate=True)
    ctx = torch.randn(1, 8, 4096, device=dev)
    chunks = [torch.randn(1, 16, f, 8, 8, device=dev) for f in [2] + [1] * 10]
    graphed = GraphedStreamForward(model)
    outs = []
    with torch.inference_mode():
        for m, forward in ((model, graphed), (emulated, emulated.forward_stream)):
            cache, cross = m.new_cache(1, (8, 8), num_kv_cache=3, sink=1, refresh_at=5), m.cross_kv(ctx)
            outs.append(torch.cat([forward(c, torch.tensor([600.0], device=dev), cache, cross) for c in chunks], 2))
    assert graphed.replays > 0
    got, ref = (o.float() for o in outs)
    assert ((got - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.gpu
def test_load_models_converts_the_dit_on_a_capable_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability >= 8.9")
    models = load_models(load_config("tiny-random", ["model.device=cuda", "model.fp8_linear=true"]))
    assert _linear_names(models.dit, FP8Linear) == {f"blocks.{i}.{p}" for i in range(4) for p in BLOCK_LINEARS}
    assert models.dit.blocks[0].ffn[0].weight.is_cuda
