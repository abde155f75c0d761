"""WanVaceDiT against diffusers' WanVACETransformer3DModel on the same random weights, on configs the
presets do not use, and its checkpoint names."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from loom_live.engine.models.checkpoint_io import CheckpointError
from loom_live.engine.models.dit_convert import to_diffusers_key, to_wan_key
from loom_live.engine.models.wan_dit import WanDiT
from loom_live.engine.models.wan_vace import VACE_PRESETS, ControlLatents, WanVaceConfig, WanVaceDiT, vace_preset

diffusers = pytest.importorskip("diffusers", reason="the diffusers oracle is in the test extra")
from tests.fakes.wan_models import diffusers_vace_twin, random_vace  # noqa: E402

SMALL = dict(text_dim=32, text_len=16, freq_dim=32)
CONFIGS = {
    "two-of-three": WanVaceConfig(dim=48, ffn_dim=64, num_heads=2, num_layers=3, vace_layers=(0, 2), **SMALL),
    "every-layer-no-cross-norm": WanVaceConfig(dim=36, ffn_dim=40, num_heads=3, num_layers=3, vace_layers=(0, 1, 2),
                                               vace_in_channels=20, cross_attn_norm=False, **SMALL),
    "first-only": WanVaceConfig(dim=32, ffn_dim=48, num_heads=2, num_layers=2, vace_layers=(0,),
                                vace_in_channels=8, **SMALL),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_shot_forward_matches_diffusers(name):
    cfg = CONFIGS[name]
    model = random_vace(cfg)
    twin = diffusers_vace_twin(cfg, model)
    torch.manual_seed(1)
    x = torch.randn(2, 16, 3, 4, 6)
    control = torch.randn(2, cfg.vace_in_channels, 3, 4, 6)
    t = torch.tensor([700.0, 250.0])
    ctx = torch.randn(2, cfg.text_len, cfg.text_dim)
    with torch.no_grad():
        ours = model(x, t, ctx, control=ControlLatents(control, 0.6))
        theirs = twin(x, t, ctx, control_hidden_states=control,
                      control_hidden_states_scale=torch.full((len(cfg.vace_layers),), 0.6), return_dict=False)[0]
        plain = WanDiT.forward(model, x, t, ctx)  # the same weights without the control branch
    assert ours.shape == x.shape
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - plain).abs().max() > 1e-2  # the control branch changes the output


def test_zero_scale_is_the_plain_dit():
    cfg = CONFIGS["two-of-three"]
    model = random_vace(cfg)
    torch.manual_seed(2)
    x, t, ctx = torch.randn(1, 16, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 5, cfg.text_dim)
    with torch.no_grad():
        off = model(x, t, ctx, control=ControlLatents(torch.randn(1, cfg.vace_in_channels, 2, 4, 4), 0.0))
        assert torch.equal(off, WanDiT.forward(model, x, t, ctx))


def test_checkpoint_names_are_wan_vace_and_diffusers_converts_them(tmp_path):
    """Our names are Wan2.1-VACE's: diffusers' own original->diffusers converter maps them onto its class."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    cfg = CONFIGS["two-of-three"]
    model = random_vace(cfg)
    ours = model.state_dict()
    for key in ("vace_patch_embedding.weight", "vace_blocks.0.before_proj.weight", "vace_blocks.1.after_proj.bias",
                "vace_blocks.1.self_attn.norm_q.weight", "vace_blocks.0.modulation"):
        assert key in ours
    assert "vace_blocks.1.before_proj.weight" not in ours  # only the first control block projects in
    twin = diffusers_vace_twin(cfg)
    converted = convert_wan_transformer_to_diffusers(dict(ours))
    assert set(converted) == set(twin.state_dict())
    assert all(torch.equal(converted[to_diffusers_key(k)], v) for k, v in ours.items())
    assert {to_wan_key(k) for k in twin.state_dict()} == set(ours)


def test_strict_loading_from_both_layouts(tmp_path):
    cfg = CONFIGS["first-only"]
    model = random_vace(cfg, seed=3)
    original = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(original))
    hf = tmp_path / "hf" / "transformer"
    hf.mkdir(parents=True)
    save_file({to_diffusers_key(k): v.contiguous() for k, v in model.state_dict().items()},
              str(hf / "diffusion_pytorch_model.safetensors"))
    for path in (original, hf.parent):
        loaded = WanVaceDiT.from_checkpoint(path, cfg)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())


def test_plain_checkpoint_in_a_vace_model_names_the_missing_control_keys(tmp_path):
    cfg = CONFIGS["first-only"]
    plain = tmp_path / "plain.safetensors"
    dit = WanDiT(cfg)  # the same shape without the control branch
    save_file({k: v.contiguous() for k, v in dit.state_dict().items() if not k.startswith("vace")}, str(plain))
    with pytest.raises(CheckpointError, match=r"missing keys.*vace_"):
        WanVaceDiT.from_checkpoint(plain, cfg)
    vace = tmp_path / "vace.safetensors"
    save_file({k: v.contiguous() for k, v in random_vace(cfg).state_dict().items()}, str(vace))
    with pytest.raises(CheckpointError, match=r"unexpected keys.*vace_"):
        WanDiT.from_checkpoint(vace, cfg)


def test_presets_match_the_releases():
    small, big = VACE_PRESETS["wan2.1-vace-1.3b"], VACE_PRESETS["wan2.1-vace-14b"]
    assert small.vace_layers == tuple(range(0, 30, 2)) and small.vace_in_channels == 96
    assert big.vace_layers == (0, 5, 10, 15, 20, 25, 30, 35) and (big.dim, big.num_layers) == (5120, 40)
    with torch.device("meta"):
        n = sum(p.numel() for p in WanVaceDiT(small).parameters())
    assert 2.0e9 < n < 2.2e9  # Wan2.1-VACE-1.3B: the 1.42B DiT plus 15 control blocks
    with pytest.raises(ValueError, match="vace_layers"):
        vace_preset("tiny-vace", vace_layers=(1, 2))
    with pytest.raises(ValueError, match="unknown VACE preset"):
        vace_preset("vace9")


def test_mismatched_control_is_named():
    cfg = CONFIGS["first-only"]
    model = random_vace(cfg)
    x, t, ctx = torch.randn(1, 16, 2, 4, 4), torch.tensor([1.0]), torch.randn(1, 4, cfg.text_dim)
    with pytest.raises(ValueError, match="control latents give the token grid"):
        model(x, t, ctx, control=ControlLatents(torch.randn(1, cfg.vace_in_channels, 1, 4, 4)))
    with pytest.raises(ValueError, match="control latents must be"):
        model(x, t, ctx, control=ControlLatents(torch.randn(1, 3, 2, 4, 4)))
    with pytest.raises(ValueError, match="needs control latents"):
        model(x, t, ctx)
