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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from loom_live.engine.edit.checkpoint import load_lllite, load_unet, load_vae, qwen3_vl_key
from loom_live.engine.edit.lllite import LLLite, select_hooks
from loom_live.engine.edit.unet import UNET_PRESETS, EditUNet
from loom_live.engine.edit.vae import VAE_PRESETS
from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files, load_into_module

LATENT_SCALE = 8  # pixels per latent cell of the edit autoencoder
QWEN3_VL_TYPES = ("qwen3_vl",)  # config.json `model_type` of the encoder edit.encoder_path names
META = torch.device("meta")
# the files transformers builds the Qwen tokenizer from (without them it builds an empty one, without a word)
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))
# what each key takes, said with its refusals
ALLOWED = {
    "edit.checkpoint": "a DreamLite UNet: a diffusers-layout directory (unet/ holding config.json and its "
                       "safetensors) or a UNet weights file of edit.unet's architecture",
    "edit.vae_checkpoint": "a TAESD tiny autoencoder (diffusers AutoencoderTiny): a directory (vae/ or config.json "
                           "beside its safetensors) or a weights file of edit.vae's architecture",
    "edit.lllite": "a temporal-LLLite adapter file (modules_dict.* keys) trained for this UNet",
    "edit.encoder_path": "a Qwen3-VL-2B model directory (config.json, tokenizer files and safetensors weights)",
}


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


@contextmanager
def _refused_as(key: str, what: str = "", allowed: str | None = None) -> Iterator[None]:
    """A refusal inside names the key it came from (`what`: which part of it) and what that takes (`allowed`;
    None: what the key takes)."""
    allowed = allowed or ALLOWED[key]
    try:
        yield
    except OSError as exc:  # a file or folder this user may not read
        raise CheckpointError(f"{key}{what}: {exc.filename or exc}: cannot be read "
                              f"({exc.strerror or type(exc).__name__}); expected {allowed}") from None
    except CheckpointError as exc:
        raise CheckpointError(f"{key}{what}: {exc}; expected {allowed}") from None


def check_edit_files(cfg: Any) -> None:
    """Raise CheckpointError (a ValueError) naming the first file that is not what its key needs, and its key."""
    e = cfg.edit
    if e.checkpoint:
        with _refused_as("edit.checkpoint"):
            unet = load_unet(e.checkpoint, UNET_PRESETS[e.unet], META, torch.float32)
    else:
        with torch.device("meta"):
            unet = EditUNet(UNET_PRESETS[e.unet])
    vae = vae_weights(e)
    if vae:
        key, what = ("edit.vae_checkpoint", "") if e.vae_checkpoint else ("edit.checkpoint", " (its vae/)")
        with _refused_as(key, what, ALLOWED["edit.vae_checkpoint"]):
            load_vae(vae, VAE_PRESETS[e.vae], META, torch.float32)
    if e.lllite:
        lllite = build_lllite(unet, cfg, META)
        if lllite is not None:
            with _refused_as("edit.lllite"):
                load_lllite(lllite, e.lllite, unet.hook_points(), META, torch.float32)
    if e.encoder == "qwen3-vl" and e.encoder_path:
        with _refused_as("edit.encoder_path"):
            check_qwen3_vl(e.encoder_path, unet.cfg.context_in)


def check_qwen3_vl(path: str, width: int) -> None:
    """A Qwen3-VL model directory of the UNet's conditioning `width`: its config.json names a Qwen3-VL model,
    its tokenizer files are there and its weight files hold every weight of that model. transformers would
    otherwise build an empty tokenizer, or draw the missing weights at random, and say it only in its log."""
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not folder.is_dir() or not config.is_file():
        raise CheckpointError(f"{folder}: not a model directory (no config.json in it)")
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
        model_type = settings.get("model_type")
    except (OSError, ValueError, AttributeError):
        raise CheckpointError(f"{config}: not a readable model config.json") from None
    if model_type not in QWEN3_VL_TYPES:
        raise CheckpointError(f"{config}: model_type {str(model_type)[:40]!r} is not a Qwen3-VL model "
                              f"({', '.join(QWEN3_VL_TYPES)})")
    text = settings.get("text_config")
    hidden = text.get("hidden_size") if isinstance(text, dict) else None
    if hidden != width:
        raise CheckpointError(f"{config}: a Qwen3-VL of hidden size {str(hidden)[:20]}; this UNet's conditioning "
                              f"is {width} wide")
    if not any(all((folder / name).is_file() for name in names) for names in TOKENIZER_FILES):
        raise CheckpointError(f"{folder}: no tokenizer files ({' or '.join(' + '.join(n) for n in TOKENIZER_FILES)})")
    _check_qwen3_vl_weights(folder)


def _check_qwen3_vl_weights(folder: Path) -> None:
    """Every weight of the base model the config describes is in the files, at its shape, under a key layout
    transformers loads (`qwen3_vl_key`); keys it leaves unused are no harm, and the language head, which the
    encoder drops, may be left out."""
    try:
        from transformers import Qwen3VLConfig, Qwen3VLModel
    except ImportError:
        raise CheckpointError("edit.encoder=qwen3-vl needs transformers: pip install 'loom-live[edit]'") from None
    try:
        config = Qwen3VLConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{folder / 'config.json'}: not a Qwen3-VL config ({str(exc)[:200]})") from None
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    names = set(model.state_dict())

    def rename(key: str) -> str | None:
        name = qwen3_vl_key(key)
        return name if name in names else None

    load_into_module(model, checkpoint_files(folder), rename, device=META)
