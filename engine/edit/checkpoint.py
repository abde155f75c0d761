"""Loading the released DreamLite and temporal-LLLite weights, strictly.

A DreamLite checkpoint in diffusers' layout (carlofkl/DreamLite-mobile, revision `diffusers`) is
a directory with `unet/` and `vae/` subfolders, each a `config.json` beside its safetensors. The
modules here keep diffusers' parameter names, so loading is a direct copy; the architecture is
built from the checkpoint's own config.json when it has one (the preset's otherwise), so the
weights always meet the model they were saved from. A missing or unexpected key, or a shape that
differs, fails with an error naming them.

A temporal-LLLite file holds adapters for every hook point of the UNet (108 for DreamLite); a run
hooking a subset (the 38 in the down blocks) skips the others, while a key that names no hook
point of this UNet fails.

The Qwen3-VL encoder loads through transformers; `qwen3_vl_key` says which of its files' key layouts
that load takes, so the check before an engine starts accepts the same ones.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from loom_live.engine.edit.lllite import module_key
from loom_live.engine.edit.unet import EditUNet, EditUNetConfig
from loom_live.engine.edit.vae import TinyVAE, TinyVAEConfig
from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files, load_into_module

__all__ = ["CheckpointError", "load_unet", "load_vae", "load_lllite", "qwen3_vl_key"]

log = logging.getLogger(__name__)

LLLITE_PREFIX = "modules_dict."
CONFIG = "config.json"
QWEN3_VL_BASE = "model."  # what Qwen3VLForConditionalGeneration's files put before its base model's keys
QWEN3_VL_HEAD = "lm_head."  # the language head, which the encoder drops


def _folder(path: str | Path, sub: str) -> Path:
    """A model directory's subfolder when it has one, else the path itself."""
    p = Path(path).expanduser()
    return p / sub if (p / sub).is_dir() else p


def _own_config(folder: Path) -> Path | None:
    return folder / CONFIG if folder.is_dir() and (folder / CONFIG).is_file() else None


def load_unet(path: str | Path, preset: EditUNetConfig | None, device: torch.device,
              dtype: torch.dtype) -> EditUNet:
    """The UNet of a DreamLite directory (or weights file), built from its config.json if it has one."""
    folder = _folder(path, "unet")
    config = _own_config(folder)
    cfg = _read_config(EditUNetConfig.from_file, config) if config else preset
    if cfg is None:
        raise CheckpointError(f"{folder}: no {CONFIG} beside the UNet weights and no edit.unet preset to build")
    if config and preset is not None and cfg != preset:
        log.warning("%s describes another UNet than the edit.unet preset; building the checkpoint's", config)
    with torch.device("meta"):
        unet = EditUNet(cfg)
    load_into_module(unet, checkpoint_files(folder), lambda k: k, device=device, dtype=dtype)
    return unet.eval()


def load_vae(path: str | Path, preset: TinyVAEConfig, device: torch.device, dtype: torch.dtype) -> TinyVAE:
    """The tiny autoencoder of a DreamLite directory (or weights file), with its config's latent scaling."""
    folder = _folder(path, "vae")
    config = _own_config(folder)
    cfg = _read_config(TinyVAEConfig.from_file, config) if config else preset
    with torch.device("meta"):
        vae = TinyVAE(cfg)
    load_into_module(vae, checkpoint_files(folder), lambda k: k, device=device, dtype=dtype)
    return vae.eval()


def _read_config(read, config: Path):
    try:
        return read(config)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


def load_lllite(lllite: nn.Module, path: str | Path, all_points: list[str], device: torch.device,
                dtype: torch.dtype) -> None:
    """Adapter weights for the hooked subset; keys of this UNet's other hook points are skipped."""
    hooked = set(lllite.modules_dict.keys())
    known = {module_key(p) for p in all_points}

    def rename(key: str) -> str | None:
        name = key if key.startswith(LLLITE_PREFIX) else LLLITE_PREFIX + key
        hook = name[len(LLLITE_PREFIX):].split(".", 1)[0]
        if hook in known and hook not in hooked:
            return None  # an adapter of a hook point this run leaves out
        return name

    load_into_module(lllite, checkpoint_files(path), rename, device=device, dtype=dtype)


def qwen3_vl_key(key: str) -> str | None:
    """A Qwen3-VL file's key as transformers' base model (Qwen3VLModel, what the encoder keeps) names it; None
    for the language head. The hub's files (from Qwen3VLForConditionalGeneration) put `model.` before the base
    model's keys and a saved Qwen3VLModel does not; transformers' from_pretrained loads both, by the base
    model's prefix, and maps no other layout for Qwen3-VL: the Qwen2-VL-era `model.layers.*` would load as
    random weights, so it stays refused (its language-model keys missing)."""
    if key.startswith(QWEN3_VL_HEAD):
        return None
    return key.removeprefix(QWEN3_VL_BASE)
