"""Tiny Wan DiTs with random weights, and diffusers' WanTransformer3DModel twin as the oracle."""

from __future__ import annotations

from dataclasses import replace

import torch

from loom_live.engine.models.dit_convert import to_diffusers_key
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT, WanDiTConfig

CFG = WanDiTConfig(dim=48, ffn_dim=64, num_heads=2, num_layers=2, text_dim=32, text_len=16, freq_dim=32)


def random_model(cfg: WanDiTConfig = CFG, seed: int = 0) -> WanDiT:
    torch.manual_seed(seed)
    model = WanDiT(cfg).eval()
    with torch.no_grad():  # non-trivial values everywhere, norms and modulations included
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def refined_model(slots: int = 1, source_channels: int = 0, layers: int = 1, edges: bool = False) -> WanDiT:
    """The embedded preset's x0 head and latent refiner on 8 latent channels, the refiner's last layer
    and its style layer given values (both start at zero) so that they take part."""
    cfg = replace(DIT_PRESETS["embedded"], num_layers=layers, in_channels=8, out_channels=8, refiner_width=12,
                  refiner_slots=slots, source_channels=source_channels, source_edges=edges)
    torch.manual_seed(0)
    model = WanDiT(cfg).eval()
    with torch.no_grad():
        for p in [*model.head.refiner.out.parameters(), *model.head.refiner.style.parameters()]:
            p.normal_(0.0, 0.2)
    return model


def _shape(cfg: WanDiTConfig, cross_attn_norm: bool) -> dict:
    """The constructor arguments diffusers' Wan transformers share, from a Loom config."""
    return dict(patch_size=cfg.patch_size, num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
                in_channels=cfg.in_channels, out_channels=cfg.out_channels, text_dim=cfg.text_dim,
                freq_dim=cfg.freq_dim, ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers,
                cross_attn_norm=cross_attn_norm, qk_norm="rms_norm_across_heads", eps=cfg.eps)


def diffusers_twin(cfg: WanDiTConfig = CFG, model: WanDiT | None = None, cross_attn_norm: bool = True):
    """diffusers' Wan transformer of the same shape; with `model`, loaded with its weights."""
    import diffusers

    twin = diffusers.WanTransformer3DModel(
        **_shape(cfg, cross_attn_norm),
        image_dim=None,
        added_kv_proj_dim=None,
        rope_max_seq_len=1024,
    ).eval()
    if model is not None:
        twin.load_state_dict({to_diffusers_key(k): v for k, v in model.state_dict().items()}, strict=True)
    return twin


def random_vace(cfg, seed: int = 0):
    """A WanVaceDiT of `cfg` with non-trivial random values everywhere."""
    from loom_live.engine.models.wan_vace import WanVaceDiT

    torch.manual_seed(seed)
    model = WanVaceDiT(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def diffusers_vace_twin(cfg, model=None):
    """diffusers' WanVACETransformer3DModel of the same shape; with `model`, loaded with its weights."""
    import diffusers

    twin = diffusers.WanVACETransformer3DModel(
        **_shape(cfg, cfg.cross_attn_norm),
        vace_layers=list(cfg.vace_layers),
        vace_in_channels=cfg.vace_in_channels,
    ).eval()
    if model is not None:
        twin.load_state_dict({to_diffusers_key(k): v for k, v in model.state_dict().items()}, strict=True)
    return twin
