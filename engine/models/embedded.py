"""Loom's embedded default model: a tiny causal Wan DiT and a per-frame VAE, trained by
Loom's own recipe (`python -m loom_live.engine.train`, docs/embedded-model.md) and shipped in the package.

The architecture is fixed here; the weights file carries the trained values and the VAE's latent
statistics (its metadata), and its SHA-256 is recorded below so a corrupted or swapped file is
refused at load instead of restyling with the wrong weights. Matrices and convolution kernels are
stored as int8 with one float16 scale per output channel (half the size of float16, so the package
stays small; the restyled frames move by well under one grey level on average), everything else
as float16, and so are the DiT's two input layers that read the source (`FLOAT16_KEYS`): their
columns meet inputs of different scales, and one int8 scale per output channel, set by the largest
weight, would round the weights of the rarely large inputs (the edges) to a few levels; and so is
the refiner's style layer, which starts at zero (no int8 scale to take).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from loom_live.engine.models.frame_vae import FrameVAE, FrameVAEConfig
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.host_bridge.wire.files import write_replacing

EMBEDDED_DIT = DIT_PRESETS["embedded"]
STYLE_TEXT_DIM = EMBEDDED_DIT.text_dim  # the style text encoder's vector size (engine/stream/style_text.py)
STYLE_TEXT_LEN = EMBEDDED_DIT.text_len  # tokens per prompt: the style vector in the first, zeros after
EMBEDDED_VAE = FrameVAEConfig()
WEIGHTS_PACKAGE = "loom_live.engine.models"
WEIGHTS_NAME = "weights/embedded.safetensors"
SCALE_SUFFIX = "#scale"  # never part of a state-dict name
WEIGHTS_SHA256 = "c734da0c9ba35af230d3a399afdee6aa25ec03c9418ab6720105695d7fa466e7"
FLOAT16_KEYS = ("dit.patch_embedding.weight", "dit.head.refiner.inp.weight", "dit.head.refiner.style.weight")


class EmbeddedWeightsError(RuntimeError):
    """The shipped weights are missing or are not the recorded file."""


def weights_path() -> Path:
    return Path(str(resources.files(WEIGHTS_PACKAGE).joinpath(WEIGHTS_NAME)))


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_embedded(path: str | Path, dit: WanDiT, vae: FrameVAE, meta: dict) -> str:
    """Write both models to one safetensors file (metadata: VAE latent stats + `meta`) and return its
    sha256. Written whole or not at all (`write_replacing`): a training run stopped while saving (Ctrl-C,
    a full disk) leaves its last checkpoint readable."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    for part, model in (("dit", dit), ("vae", vae)):
        for name, value in model.state_dict().items():
            tensors.update(_pack(f"{part}.{name}", value.detach().to("cpu", torch.float32)))
    info = {"latents_mean": list(vae.cfg.latents_mean), "latents_std": list(vae.cfg.latents_std), **meta}
    data = save(tensors, metadata={"loom": json.dumps(info)})
    write_replacing(Path(path), lambda f: f.write(data))
    return hashlib.sha256(data).hexdigest()


def _pack(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """A tensor as stored: int8 plus a per-output-channel scale (`key + SCALE_SUFFIX`) for matrices and
    kernels, float16 for vectors and `FLOAT16_KEYS`."""
    if value.ndim < 2 or key in FLOAT16_KEYS:
        return {key: value.to(torch.float16).contiguous()}
    scale = (value.abs().flatten(1).amax(1).clamp_min(1e-12) / 127.0).to(torch.float16)
    shape = (-1,) + (1,) * (value.ndim - 1)
    q = torch.round(value / scale.float().view(shape)).clamp(-127, 127).to(torch.int8)
    return {key: q.contiguous(), key + SCALE_SUFFIX: scale.contiguous()}


def _unpack(key: str, value: torch.Tensor, stored: Any) -> torch.Tensor:
    if value.dtype != torch.int8:
        return value
    scale = stored.get_tensor(key + SCALE_SUFFIX).float()
    return (value.float() * scale.view((-1,) + (1,) * (value.ndim - 1))).to(torch.float16)


def read_embedded(path: str | Path | None = None, check_hash: bool = True) -> tuple[dict, dict, dict]:
    """(dit state, vae state, metadata) from the weights file, checked against the recorded hash."""
    from safetensors import safe_open

    path = Path(path).expanduser() if path is not None else weights_path()
    if not path.is_file():
        raise EmbeddedWeightsError(f"{path}: the embedded model's weights are missing; reinstall Loom "
                                   "or train them with `python -m loom_live.engine.train`")
    if check_hash and path == weights_path() and file_sha256(path) != WEIGHTS_SHA256:
        raise EmbeddedWeightsError(f"{path}: SHA-256 {file_sha256(path)} differs from the recorded "
                                   f"{WEIGHTS_SHA256}; the file is damaged or not the shipped one")
    dit, vae = {}, {}
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("loom", "{}"))
        for key in f.keys():
            if key.endswith(SCALE_SUFFIX):
                continue
            part, _, name = key.partition(".")
            (dit if part == "dit" else vae)[name] = _unpack(key, f.get_tensor(key), f)
    return dit, vae, meta


def check_embedded_file(path: str | Path) -> None:
    """A weights file given to the embedded preset (`model.checkpoint`), read for its keys and shapes only (no
    weights), before an engine starts: one .safetensors file of the DiT and the VAE as `save_embedded` writes
    them, not a Wan checkpoint (those are for the Wan presets). Raises CheckpointError naming the file."""
    from torch import nn

    from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files, load_into_module

    file = Path(path).expanduser()
    files = checkpoint_files(file)  # there, and a file or folder of a checkpoint format
    if files != [file] or not file.name.endswith(".safetensors"):
        raise CheckpointError(f"{file}: the embedded preset reads one .safetensors file of its DiT and VAE, as "
                              "`loom train` writes it; Wan2.1 checkpoints are for the wan2.1 presets")
    with torch.device("meta"):
        both = nn.ModuleDict({"dit": WanDiT(EMBEDDED_DIT), "vae": FrameVAE(EMBEDDED_VAE)})
    load_into_module(both, files, lambda key: None if key.endswith(SCALE_SUFFIX) else key, device="meta")


def vae_config(meta: dict) -> FrameVAEConfig:
    return replace(EMBEDDED_VAE, latents_mean=tuple(meta["latents_mean"]), latents_std=tuple(meta["latents_std"]))


def load_embedded(device: torch.device, dtype: torch.dtype, path: str | Path | None = None
                  ) -> tuple[WanDiT, FrameVAE, dict]:
    """The trained embedded DiT and VAE on `device` in `dtype`, strictly loaded."""
    dit_state, vae_state, meta = read_embedded(path)
    with torch.device("meta"):
        dit, vae = WanDiT(EMBEDDED_DIT), FrameVAE(vae_config(meta))
    try:
        dit.load_state_dict(dit_state, strict=True, assign=True)
        vae.load_state_dict(vae_state, strict=True, assign=True)
    except RuntimeError as e:
        detail = [line.strip() for line in str(e).splitlines() if line.strip()][-1]
        raise EmbeddedWeightsError(f"{path or weights_path()}: not weights of the embedded model's layout "
                                   f"(train them with this version of Loom): {detail}") from e
    vae._set_latent_stats(device)
    dit = dit.to(device=device, dtype=dtype).eval().requires_grad_(False)
    vae = vae.to(device=device, dtype=dtype).eval().requires_grad_(False)
    return dit, vae, meta
