"""Loading the released DreamLite-mobile and temporal-LLLite weights, strictly.

The UNet and autoencoder use diffusers' names, which the modules here keep, so loading is a
direct copy: a DreamLite-mobile directory holds `unet/` and `vae/` subfolders. A temporal-LLLite
file holds adapters for every hook point of the UNet (108); a run hooking a subset (the 38 in the
down blocks) skips the others, while a key that names no hook point of this UNet, a missing key
or a shape that differs fails with an error naming them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.edit.lllite import module_key
from engine.models.checkpoint_io import CheckpointError, checkpoint_files, load_into_module

__all__ = ["CheckpointError", "load_unet", "load_vae", "load_lllite"]

LLLITE_PREFIX = "modules_dict."


def _part(path: str | Path, sub: str) -> list[Path]:
    """A model directory's subfolder when it has one, else the path itself."""
    p = Path(path).expanduser()
    return checkpoint_files(p / sub if (p / sub).is_dir() else p)


def load_unet(unet: nn.Module, path: str | Path, device: torch.device, dtype: torch.dtype) -> None:
    load_into_module(unet, _part(path, "unet"), lambda k: k, device=device, dtype=dtype)


def load_vae(vae: nn.Module, path: str | Path, device: torch.device, dtype: torch.dtype) -> None:
    load_into_module(vae, _part(path, "vae"), lambda k: k, device=device, dtype=dtype)


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
