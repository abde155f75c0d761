"""Key mapping between the original `Wan2.1_VAE.pth` names and Loom's (diffusers') names."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.models import vae_convert
from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE


def _meta_state(cfg) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        return WanVAE(cfg).state_dict()


@pytest.mark.parametrize("preset", ["wan2.1", "tiny"])
def test_original_names_round_trip(preset):
    cfg = VAE_PRESETS[preset]
    native = list(_meta_state(cfg))
    original = [vae_convert.native_to_original(k, cfg) for k in native]
    assert len(set(original)) == len(native)
    assert all(vae_convert.is_original_key(k) for k in original)
    assert [vae_convert.original_to_native(k, cfg) for k in original] == native
    assert [vae_convert.wan_key_to_native(k, cfg) for k in native] == native  # diffusers names pass through


def test_original_names_agree_with_diffusers_converter():
    """diffusers' own original->diffusers converter, fed our original names, gives our names back."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    cfg = VAE_PRESETS["wan2.1"]
    state = _meta_state(cfg)
    original = {vae_convert.native_to_original(k, cfg): v for k, v in state.items()}
    converted = convert_wan_vae_to_diffusers(original)
    assert set(converted) == set(state)
    assert all(converted[k].shape == state[k].shape for k in state)


def test_known_original_keys():
    """Spot checks against names in the released Wan2.1_VAE.pth."""
    cfg = VAE_PRESETS["wan2.1"]
    expected = {
        "conv1.weight": "quant_conv.weight",
        "conv2.bias": "post_quant_conv.bias",
        "encoder.conv1.weight": "encoder.conv_in.weight",
        "encoder.downsamples.1.residual.6.weight": "encoder.down_blocks.1.conv2.weight",
        "encoder.downsamples.3.shortcut.weight": "encoder.down_blocks.3.conv_shortcut.weight",
        "encoder.downsamples.5.time_conv.weight": "encoder.down_blocks.5.time_conv.weight",
        "encoder.middle.1.to_qkv.weight": "encoder.mid_block.attentions.0.to_qkv.weight",
        "encoder.head.0.gamma": "encoder.norm_out.gamma",
        "decoder.middle.2.residual.3.gamma": "decoder.mid_block.resnets.1.norm2.gamma",
        "decoder.upsamples.3.resample.1.weight": "decoder.up_blocks.0.upsamplers.0.resample.1.weight",
        "decoder.upsamples.4.shortcut.bias": "decoder.up_blocks.1.resnets.0.conv_shortcut.bias",
        "decoder.upsamples.7.time_conv.bias": "decoder.up_blocks.1.upsamplers.0.time_conv.bias",
        "decoder.upsamples.14.residual.0.gamma": "decoder.up_blocks.3.resnets.2.norm1.gamma",
        "decoder.head.2.weight": "decoder.conv_out.weight",
    }
    state = _meta_state(cfg)
    for original, native in expected.items():
        assert vae_convert.original_to_native(original, cfg) == native
        assert native in state


def test_original_checkpoint_loads(tmp_path):
    cfg = VAE_PRESETS["tiny"]
    torch.manual_seed(0)
    source = WanVAE(cfg).state_dict()
    path = tmp_path / "Wan2.1_VAE.pth"
    torch.save({vae_convert.native_to_original(k, cfg): v for k, v in source.items()}, path)
    loaded = WanVAE.from_checkpoint(path, cfg, dtype=torch.bfloat16).state_dict()
    assert set(loaded) == set(source)
    assert all(torch.equal(loaded[k], source[k].bfloat16()) for k in source)
    assert all(v.dtype == torch.bfloat16 for v in loaded.values())
