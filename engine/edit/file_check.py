"""What each weights file of an edit-family run holds, checked before an engine starts.

The edit family reads up to four files: the DreamLite UNet (`edit.checkpoint`), its tiny autoencoder
(`edit.vae_checkpoint`, or the checkpoint's `vae/`), the temporal LLLite adapters (`edit.lllite`) and
the Qwen3-VL encoder (`edit.encoder_path`). Each is read here for its format, keys and shapes only,
into modules built on the meta device (no weights read, no memory taken), with the same strict
loaders the engine uses, so a file that is not what its key needs is refused with one line naming it
instead of failing an engine that a host waited for. The choices of which files a run reads live here
too, so the check and the build cannot disagree.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loom_live.engine.edit.checkpoint import load_lllite, load_unet, load_vae
from loom_live.engine.edit.lllite import LLLite, select_hooks
from loom_live.engine.edit.unet import UNET_PRESETS, EditUNet
from loom_live.engine.edit.vae import VAE_PRESETS
from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files, iter_tensors

LATENT_SCALE = 8  # pixels per latent cell of the edit autoencoder
QWEN3_VL_TYPES = ("qwen3_vl",)  # config.json `model_type` of the encoder edit.encoder_path names
META = torch.device("meta")


def vae_weights(e: Any) -> str | None:
    """The autoencoder weights a run reads: edit.vae_checkpoint, else the checkpoint's vae/ (None: none)."""
    if e.vae_checkpoint:
        return e.vae_checkpoint
    return e.checkpoint if e.checkpoint and (Path(e.checkpoint).expanduser() / "vae").is_dir() else None


def build_lllite(unet: EditUNet, cfg: Any, device: torch.device) -> LLLite | None:
    """The adapters for the hook points the run uses (None: it hooks none)."""
    e = cfg.edit
    points = select_hooks(unet.hook_points(), e.lllite_hooks)
    if not points:
        return None
    with torch.device(device):
        return LLLite(unet.hook_sizes(cfg.resolution.height // LATENT_SCALE), points,
                      (cfg.resolution.height, cfg.resolution.width), e.batch)


def check_edit_files(cfg: Any) -> None:
    """Raise CheckpointError (a ValueError) naming the first file that is not what its key needs."""
    e = cfg.edit
    if e.checkpoint:
        unet = load_unet(e.checkpoint, UNET_PRESETS[e.unet], META, torch.float32)
    else:
        with torch.device("meta"):
            unet = EditUNet(UNET_PRESETS[e.unet])
    vae = vae_weights(e)
    if vae:
        load_vae(vae, VAE_PRESETS[e.vae], META, torch.float32)
    if e.lllite:
        lllite = build_lllite(unet, cfg, META)
        if lllite is not None:
            load_lllite(lllite, e.lllite, unet.hook_points(), META, torch.float32)
    if e.encoder == "qwen3-vl" and e.encoder_path:
        check_qwen3_vl(e.encoder_path)


def check_qwen3_vl(path: str) -> None:
    """A Qwen3-VL model directory: its config.json names a Qwen3-VL model and its weight files read."""
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not folder.is_dir() or not config.is_file():
        raise CheckpointError(f"{folder}: edit.encoder_path needs a Qwen3-VL-2B model directory (config.json "
                              "beside its safetensors weights)")
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise CheckpointError(f"{config}: not a readable model config.json") from None
    if model_type not in QWEN3_VL_TYPES:
        raise CheckpointError(f"{config}: model_type {str(model_type)[:40]!r} is not a Qwen3-VL model; "
                              f"edit.encoder_path needs one ({', '.join(QWEN3_VL_TYPES)})")
    for _ in iter_tensors(checkpoint_files(folder), meta=True):
        pass
