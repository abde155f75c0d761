"""WanDiT against diffusers' WanTransformer3DModel on the same random weights, and key layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loom_live.engine.models.dit_convert import to_diffusers_key, to_wan_key
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT, WanDiTConfig, preset

diffusers = pytest.importorskip("diffusers", reason="the diffusers oracle is in the test extra")
from tests.fakes.wan_models import CFG, diffusers_twin, random_model  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    model = random_model()
    twin = diffusers_twin()
    twin.load_state_dict({to_diffusers_key(k): v for k, v in model.state_dict().items()}, strict=True)
    return model, twin


def test_full_sequence_matches_diffusers(pair):
    model, twin = pair
    torch.manual_seed(1)
    x = torch.randn(2, 16, 3, 8, 6)
    t = torch.tensor([700.0, 250.0])
    ctx = torch.randn(2, CFG.text_len, CFG.text_dim)
    with torch.no_grad():
        ours = model(x, t, ctx)
        theirs = twin(x, t, ctx, return_dict=False)[0]
    assert ours.shape == x.shape
    assert (ours - theirs).abs().max() < 1e-4
    assert ours.abs().max() > 0.1  # a real signal, not two zeros agreeing


def test_per_frame_timesteps_match_diffusers_per_token(pair):
    """CausVid-style [B, F] timesteps equal diffusers' per-token timesteps repeated per frame."""
    model, twin = pair
    torch.manual_seed(2)
    x = torch.randn(1, 16, 3, 4, 6)
    t = torch.tensor([[900.0, 500.0, 100.0]])
    ctx = torch.randn(1, CFG.text_len, CFG.text_dim)
    with torch.no_grad():
        ours = model(x, t, ctx)
        theirs = twin(x, t.repeat_interleave(2 * 3, dim=1), ctx, return_dict=False)[0]
    assert (ours - theirs).abs().max() < 1e-4


def test_short_prompt_is_zero_padded_to_text_len(pair):
    model, _ = pair
    ctx = torch.randn(1, 5, CFG.text_dim)
    padded = torch.nn.functional.pad(ctx, (0, 0, 0, CFG.text_len - 5))
    x, t = torch.randn(1, 16, 1, 4, 4), torch.tensor([500.0])
    with torch.no_grad():
        assert torch.equal(model(x, t, ctx), model(x, t, padded))


def test_original_keys_round_trip_through_diffusers_converter(pair):
    """diffusers' own Wan2.1-original -> diffusers converter reads our names as Wan2.1 names."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    model, twin = pair
    ours = model.state_dict()
    converted = convert_wan_transformer_to_diffusers(dict(ours))
    assert set(converted) == set(twin.state_dict())
    assert all(torch.equal(converted[to_diffusers_key(k)], v) for k, v in ours.items())
    back = {to_wan_key(k): v for k, v in twin.state_dict().items()}
    assert set(back) == set(ours)
    assert all(torch.equal(back[k], v) for k, v in ours.items())


def test_wan_original_names():
    names = set(WanDiT(CFG).state_dict())
    for key in (
        "patch_embedding.weight",
        "text_embedding.2.bias",
        "time_embedding.0.weight",
        "time_projection.1.weight",
        "blocks.1.self_attn.norm_q.weight",
        "blocks.0.cross_attn.o.bias",
        "blocks.0.norm3.weight",
        "blocks.1.ffn.2.weight",
        "blocks.0.modulation",
        "head.head.weight",
        "head.modulation",
    ):
        assert key in names
    assert to_wan_key("model.blocks.0.self_attn.q.weight") == "blocks.0.self_attn.q.weight"
    assert to_wan_key("model.diffusion_model.head.modulation") == "head.modulation"


def test_pipeline_pieces_compose_to_forward(pair):
    model, _ = pair
    from loom_live.engine.models.wan_dit import FullSequenceAttention

    torch.manual_seed(3)
    x, t, ctx = torch.randn(1, 16, 2, 4, 4), torch.tensor([400.0]), torch.randn(1, CFG.text_len, CFG.text_dim)
    with torch.no_grad():
        tokens, cond, grid = model.embed(x, t)
        attend = FullSequenceAttention(model.rope(tokens.device), grid, None)
        cross = model.cross_kv(ctx)
        mid = model.run_blocks(0, 1, tokens, cond, cross, attend)
        late_cond = model.condition(t, grid[0])  # another rank recomputes the conditioning
        out = model.head(model.run_blocks(1, 2, mid, late_cond, cross, attend), late_cond, grid)
        assert torch.equal(out, model(x, t, ctx))


def test_presets():
    assert DIT_PRESETS["wan2.1-1.3b"].head_dim == 128 and DIT_PRESETS["wan2.1-1.3b"].num_layers == 30
    big = DIT_PRESETS["wan2.1-14b"]
    assert (big.dim, big.ffn_dim, big.num_heads, big.num_layers) == (5120, 13824, 40, 40)
    with torch.device("meta"):
        n = sum(p.numel() for p in WanDiT(DIT_PRESETS["wan2.1-1.3b"]).parameters())
    assert 1.35e9 < n < 1.45e9  # Wan2.1-T2V-1.3B has 1.42B parameters
    tiny = sum(p.numel() for p in WanDiT(DIT_PRESETS["tiny"]).parameters())
    assert tiny < 3e6
    assert preset("tiny", num_layers=1).num_layers == 1
    with pytest.raises(ValueError, match="unknown DiT preset"):
        preset("wan9")
    with pytest.raises(ValueError, match="divisible"):
        WanDiTConfig(dim=50, num_heads=4)


def test_bad_inputs_are_named(pair):
    model, _ = pair
    with pytest.raises(ValueError, match="latents must be"):
        model(torch.randn(1, 4, 1, 4, 4), torch.tensor([1.0]), torch.randn(1, 4, CFG.text_dim))
    with pytest.raises(ValueError, match="context must be"):
        model(torch.randn(1, 16, 1, 4, 4), torch.tensor([1.0]), torch.randn(1, 4, 7))
    with pytest.raises(ValueError, match="timestep must be"):
        model(torch.randn(1, 16, 2, 4, 4), torch.ones(1, 3), torch.randn(1, 4, CFG.text_dim))


def test_no_cross_attention_norm_is_the_identity_like_diffusers():
    """cross_attn_norm=False: no norm at all before cross-attention (Wan2.1, diffusers' nn.Identity)."""
    cfg = dataclasses.replace(CFG, cross_attn_norm=False)
    model = random_model(cfg)
    twin = diffusers_twin(cfg, cross_attn_norm=False)
    twin.load_state_dict({to_diffusers_key(k): v for k, v in model.state_dict().items()}, strict=True)
    torch.manual_seed(3)
    x, t, ctx = torch.randn(1, 16, 2, 4, 6), torch.tensor([600.0]), torch.randn(1, CFG.text_len, CFG.text_dim)
    with torch.no_grad():
        assert (model(x, t, ctx) - twin(x, t, ctx, return_dict=False)[0]).abs().max() < 1e-4
