"""Building the edit family's models from the config: weights, random weights or seeded tiny ones."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from loom_live.engine.config import LoomConfig
from loom_live.engine.edit.checkpoint import load_lllite, load_unet, load_vae
from loom_live.engine.edit.encoder import (
    CONDITIONING_TOKENS,
    EditConditioner,
    HashEditEncoder,
    Qwen3VLEncoder,
    qwen3vl_2b_config,
)
from loom_live.engine.edit.file_check import LATENT_SCALE, build_lllite, vae_weights
from loom_live.engine.edit.lllite import LLLite
from loom_live.engine.edit.schedule import ShiftLine
from loom_live.engine.edit.unet import UNET_PRESETS, EditUNet
from loom_live.engine.edit.vae import VAE_PRESETS, TinyVAE
from loom_live.engine.models.loading import _seeded, resolve_device, resolve_dtype, to_channels_last

log = logging.getLogger(__name__)

__all__ = ["LATENT_SCALE", "EditModels", "check_resolution", "load_edit_encoder", "load_edit_models"]


@dataclass
class EditModels:
    unet: EditUNet
    vae: TinyVAE
    encoder: EditConditioner
    lllite: LLLite | None  # None: no hooks
    device: torch.device
    dtype: torch.dtype
    shift: ShiftLine = ShiftLine()  # the checkpoint's scheduler config, or the pipeline's defaults


def load_edit_models(cfg: LoomConfig) -> EditModels:
    e = cfg.edit
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    check_resolution(cfg)
    if e.checkpoint:  # the checkpoint's own config.json builds the UNet it was saved from
        unet = load_unet(e.checkpoint, UNET_PRESETS[e.unet], device, dtype)
    else:
        unet = _seeded_or_refused(lambda: EditUNet(UNET_PRESETS[e.unet]), e.unet == "tiny", cfg, device, dtype,
                                  "edit.checkpoint")
    check_resolution(cfg, unet.cfg.downscale)  # again: a checkpoint's own config may have more levels
    vae_path = vae_weights(e)
    if vae_path:
        vae = load_vae(vae_path, VAE_PRESETS[e.vae], device, dtype)
    else:
        vae = _seeded_or_refused(lambda: TinyVAE(VAE_PRESETS[e.vae]), e.vae == "tiny", cfg, device, dtype,
                                 "edit.vae_checkpoint")
    lllite = build_lllite(unet, cfg, device)
    if lllite is not None:
        lllite = lllite.to(dtype).eval()
        if e.lllite:
            load_lllite(lllite, e.lllite, unet.hook_points(), device, dtype)
        lllite.set_strength(e.adapter_strength)
        log.info("LLLite: %d of %d hook points (%s)", len(lllite.modules_dict), len(unet.hook_points()),
                 e.lllite_hooks)
    if device.type == "cuda":  # cuDNN's fast convolution kernels want channels-last activations
        to_channels_last(unet)
        to_channels_last(vae)
    encoder = load_edit_encoder(cfg, device, dtype, unet.cfg.context_in)
    return EditModels(unet.requires_grad_(False), vae.requires_grad_(False), encoder, lllite, device, dtype,
                      _shift_line(e.checkpoint))


def _shift_line(checkpoint: str | None) -> ShiftLine:
    config = Path(checkpoint).expanduser() / "scheduler" / "scheduler_config.json" if checkpoint else None
    return ShiftLine.from_file(config) if config is not None and config.is_file() else ShiftLine()


def check_resolution(cfg: LoomConfig, downscale: int | None = None) -> None:
    """Width and height must survive the UNet's halvings exactly (its skips are added back at each level)."""
    multiple = LATENT_SCALE * (downscale or UNET_PRESETS[cfg.edit.unet].downscale)
    for key, v in (("width", cfg.resolution.width), ("height", cfg.resolution.height)):
        if v % multiple:
            raise ValueError(f"resolution.{key}: {v} must be a multiple of {multiple} for edit.unet={cfg.edit.unet}")


def _seeded_or_refused(make: Callable[[], nn.Module], tiny: bool, cfg: LoomConfig, device: torch.device,
                       dtype: torch.dtype, key: str) -> nn.Module:
    """Seeded weights for a tiny architecture or with model.random_weights; a real size needs its weights."""
    if not tiny and not cfg.model.random_weights:
        raise ValueError(f"{key}: no weights given for a real-size model; give them, or set "
                         "model.random_weights=true to run on random weights (benchmarks)")
    return _seeded(make, cfg.model.seed, device, dtype)


def load_edit_encoder(cfg: LoomConfig, device: torch.device, dtype: torch.dtype,
                      width: int | None = None) -> EditConditioner:
    """The conditioning encoder the config names (alone: the benchmark times it apart from the UNet); the hash
    encoder is `width` wide (the UNet's, which a checkpoint's own config.json may change; None: edit.unet's)."""
    e = cfg.edit
    if e.encoder == "hash":
        dim = width or UNET_PRESETS[e.unet].context_in
        return HashEditEncoder(dim, CONDITIONING_TOKENS if e.unet != "tiny" else 24, device, dtype, cfg.model.seed)
    if e.encoder_path:
        return Qwen3VLEncoder.from_pretrained(e.encoder_path, device, dtype)
    if not cfg.model.random_weights:
        raise ValueError("edit.encoder_path: no Qwen3-VL weights given; give a Qwen3-VL-2B directory, or set "
                         "model.random_weights=true to run on random weights (benchmarks)")
    return Qwen3VLEncoder.random(qwen3vl_2b_config(), device, dtype, cfg.model.seed)
