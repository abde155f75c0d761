"""The DiT's q/k/v projections as one matrix product (`model.fuse_qkv`) compute what the three compute,
stay in step with LoRA merges, and give way to the three products when the weights move."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.models.fp8_linear import convert_dit_to_fp8
from loom_live.engine.models.lora import LoraMerger, read_lora
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from tests.fakes.wan_models import random_model
from tests.unit.test_lora_merge import _lora_file


def _stream(model: WanDiT, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    chunks = [torch.randn(1, cfg.in_channels, f, 4, 6, generator=g) for f in [2] + [1] * 7]
    ctx = torch.randn(1, 5, cfg.text_dim, generator=g)
    cache = model.new_cache(1, (4, 6), num_kv_cache=4, sink=1, refresh_at=6)
    cross = model.cross_kv(ctx)
    t = torch.tensor([700.0])
    with torch.no_grad():
        return torch.cat([model.forward_stream(x, t, cache, cross) for x in chunks], dim=2)


def _fused_products(model: WanDiT) -> int:
    return sum(b.self_attn._fused() is not None for b in model.blocks)


def test_fused_projections_equal_the_three_products():
    torch.manual_seed(0)
    model = WanDiT(DIT_PRESETS["tiny"]).eval()
    ref = _stream(model)
    names = dict(model.named_parameters())
    model.fuse_projections()
    assert _fused_products(model) == len(model.blocks)
    assert dict(model.named_parameters()).keys() == names.keys()  # the checkpoint names stay
    attn = model.blocks[0].self_attn
    assert attn.k.weight.data_ptr() == attn.qkv[1][attn.k.out_features:].data_ptr()  # views of the fused matrix
    torch.testing.assert_close(_stream(model), ref, rtol=1e-5, atol=1e-5)


def test_a_lora_merge_after_the_fusion_reaches_the_fused_product(tmp_path):
    plain, fused = random_model(), random_model()
    fused.fuse_projections()
    path = _lora_file(plain, tmp_path / "a.safetensors", 1, rank=4, alpha=2.0, bias=True)
    for model in (plain, fused):
        merger = LoraMerger(model)
        merger.add(read_lora(path, model), 0.7)
        merger.set_scale("a", -0.4)  # a live change: written into the weights in place
    assert _fused_products(fused) == len(fused.blocks)
    torch.testing.assert_close(_stream(fused, seed=2), _stream(plain, seed=2), rtol=1e-4, atol=1e-4)


def test_weights_given_storage_of_their_own_end_the_fusion():
    """`Module.to` moves every parameter to new storage: the stale fused matrix must not be used."""
    torch.manual_seed(1)
    model = WanDiT(DIT_PRESETS["tiny"]).eval()
    model.fuse_projections()
    model.to(torch.float64)
    assert _fused_products(model) == 0
    reference = WanDiT(DIT_PRESETS["tiny"]).eval()
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(_stream(model.float()), _stream(reference.float()), rtol=1e-5, atol=1e-5)


def test_fusion_refuses_fp8_layers_and_fp8_fuses_a_fused_model_again():
    model = WanDiT(DIT_PRESETS["tiny"]).eval()
    convert_dit_to_fp8(model, emulate=True)
    with pytest.raises(ValueError, match="fuse before an FP8 conversion"):
        model.fuse_projections()
    torch.manual_seed(2)
    plain = WanDiT(DIT_PRESETS["tiny"]).eval()
    fused = WanDiT(DIT_PRESETS["tiny"]).eval()
    fused.load_state_dict(plain.state_dict())
    fused.fuse_projections()  # model.fuse_qkv and model.fp8_linear together: the FP8 product replaces it
    for m in (plain, fused):
        convert_dit_to_fp8(m, emulate=True)
    assert _fused_products(fused) == len(fused.blocks)
    torch.testing.assert_close(_stream(fused), _stream(plain), rtol=0, atol=0)
    assert load_config("tiny-random", ["model.fuse_qkv=true", "model.fp8_linear=true"]).model.fuse_qkv


@pytest.mark.gpu
def test_fused_projections_inside_cuda_graphs_match_bf16():
    """The session's path on a GPU: compiled ops, steady chunks replayed as graphs, bf16."""
    from loom_live.engine.graphs.dit_steps import GraphedStreamForward

    dev = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(dev):
        model = WanDiT(DIT_PRESETS["tiny"]).to(torch.bfloat16).eval()
    chunks = [torch.randn(1, 16, f, 8, 8, device=dev) for f in [2] + [1] * 12]
    ctx = torch.randn(1, 16, 4096, device=dev)

    def stream(forward) -> torch.Tensor:
        cache = model.new_cache(1, (8, 8), num_kv_cache=3, sink=1, refresh_at=5, device=dev)
        cross, t = model.cross_kv(ctx), torch.tensor([700.0], device=dev)
        return torch.cat([forward(x, t, cache, cross) for x in chunks], dim=2).float()

    with torch.inference_mode():
        model.fuse_elementwise()
        ref = stream(model.forward_stream)
        model.fuse_projections()
        got = stream(GraphedStreamForward(model))
    assert _fused_products(model) == len(model.blocks)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
