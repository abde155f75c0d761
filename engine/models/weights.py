"""Where a preset's real weights come from, and finding them again once `loom pull` has fetched them.

A preset that needs weights (the Wan2.1 sizes; the edit family's DreamLite-mobile UNet) names, for
each config key it cannot run without, the Hugging Face repository, revision and files that fill
it. `loom pull PRESET` downloads those into the Hugging Face cache (the standard one:
`HF_HUB_CACHE` / `HF_HOME`, shared with other tools);
`fill_pulled_weights` then points every key the user left unset at the cached copy, so the preset
runs with no `--set`. A path the user gives always wins. Only the local cache is read here: loading
a config never touches the network.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WeightSource:
    """Files of one Hugging Face repository that fill one config key.

    `target` is the repository path the key points at: a file, or a folder ("" = the snapshot root).
    `notice` is said to the user before the download (a licence that restricts use). An `optional`
    source is used when pulled, and a run without it is not refused."""

    key: str
    repo: str
    files: tuple[str, ...]
    target: str
    licence: str
    what: str
    revision: str = "main"
    notice: str | None = None
    optional: bool = False


_WAN_LICENCE = "Apache-2.0"
_SDV2_LICENCE = "Apache-2.0 (StreamDiffusionV2 model card)"


def _wan_sources(size: str, causal_folder: str) -> tuple[WeightSource, ...]:
    return (
        WeightSource("model.checkpoint", "jerryfeng/StreamDiffusionV2", (f"{causal_folder}/model.pt",),
                     f"{causal_folder}/model.pt", _SDV2_LICENCE, f"StreamDiffusionV2 causal generator ({size})"),
        WeightSource("vae.checkpoint", f"Wan-AI/Wan2.1-T2V-{size}", ("Wan2.1_VAE.pth",), "Wan2.1_VAE.pth",
                     _WAN_LICENCE, "Wan2.1 VAE"),
        _umt5_source(size),
    )


def _umt5_source(size: str) -> WeightSource:
    # Loom's umT5 encoder reads the transformers layout (tokenizer/ + text_encoder/), which the
    # diffusers copy of Wan2.1 holds; Wan's own models_t5_umt5-xxl-enc-bf16.pth is another format.
    return WeightSource("prompt.path", f"Wan-AI/Wan2.1-T2V-{size}-Diffusers", ("tokenizer/*", "text_encoder/*"), "",
                        _WAN_LICENCE, "umT5-XXL text encoder and tokenizer")


def _vace_sources(size: str, dit_files: tuple[str, ...], dit_target: str) -> tuple[WeightSource, ...]:
    """Wan2.1-VACE: its DiT (original layout, control blocks included) and VAE from the VACE release; the
    umT5 encoder is Wan2.1's, in the transformers layout of the diffusers copy as above."""
    repo = f"Wan-AI/Wan2.1-VACE-{size}"
    return (
        WeightSource("model.checkpoint", repo, dit_files, dit_target, _WAN_LICENCE, f"Wan2.1-VACE DiT ({size})"),
        WeightSource("vae.checkpoint", repo, ("Wan2.1_VAE.pth",), "Wan2.1_VAE.pth", _WAN_LICENCE, "Wan2.1 VAE"),
        _umt5_source(size),
    )


_DREAMLITE_LICENCE = "non-commercial (DreamLite model licence, see the model card)"
_DREAMLITE_NOTICE = ("DreamLite's weights (ByteDance, carlofkl/DreamLite-mobile) are licensed for NON-COMMERCIAL "
                     "use only, and so is what is trained on them (the temporal LLLite adapter); read the model "
                     "card's licence before using them")

# The edit family (by edit.unet): DreamLite-mobile in diffusers' layout (its `diffusers` revision: unet/,
# vae/, scheduler/; the text encoder is Qwen3-VL-2B-Instruct, which DreamLite's code loads separately),
# and the temporal LLLite adapter of otanl/dreamlite-stream (its hub card: otnl/dreamlite-stream-temporal-lllite-v3).
_DREAMLITE_SOURCES = (
    WeightSource("edit.checkpoint", "carlofkl/DreamLite-mobile", ("unet/*", "vae/*", "scheduler/*"), "",
                 _DREAMLITE_LICENCE, "DreamLite-mobile UNet, TAESD autoencoder and scheduler (diffusers layout)",
                 revision="diffusers", notice=_DREAMLITE_NOTICE),
    WeightSource("edit.encoder_path", "Qwen/Qwen3-VL-2B-Instruct", ("*",), "", "Apache-2.0",
                 "Qwen3-VL-2B-Instruct conditioning encoder and tokenizer"),
    WeightSource("edit.lllite", "otnl/dreamlite-stream-temporal-lllite-v3", ("temporal_lllite_step001440.safetensors",),
                 "temporal_lllite_step001440.safetensors", _DREAMLITE_LICENCE + "; trained on DreamLite-mobile",
                 "temporal LLLite v3 adapter (108 hooks)", notice=_DREAMLITE_NOTICE, optional=True),
)

# By model.preset for the Wan family, by edit.unet for the edit family (a YAML file built on a preset
# finds the same weights).
PRESET_WEIGHTS: dict[str, tuple[WeightSource, ...]] = {
    "wan2.1-1.3b": _wan_sources("1.3B", "wan_causal_dmd_v2v"),
    "wan2.1-14b": _wan_sources("14B", "wan_causal_dmd_v2v_14b"),
    "dreamlite-mobile": _DREAMLITE_SOURCES,
    "wan2.1-vace-1.3b": _vace_sources("1.3B", ("diffusion_pytorch_model.safetensors",),
                                      "diffusion_pytorch_model.safetensors"),
    # seven shards (and an index where the repository has one): the snapshot folder, read as a whole
    "wan2.1-vace-14b": _vace_sources("14B", ("diffusion_pytorch_model*.safetensors*",), ""),
}
# the preset names a user gives `loom pull`
PULLABLE_PRESETS = ("wan2.1-1.3b", "wan2.1-14b", "wan2.1-vace-1.3b", "wan2.1-vace-14b", "dreamlite-edit")


def pull_name(cfg: Any) -> str:
    """The preset name `loom pull` takes for this config's weights."""
    return "dreamlite-edit" if cfg.model.family == "edit" else cfg.model.preset


def weight_sources(cfg: Any) -> tuple[WeightSource, ...]:
    """The weight sources of a config: by its edit UNet for the edit family, else by model.preset."""
    return PRESET_WEIGHTS.get(cfg.edit.unet if cfg.model.family == "edit" else cfg.model.preset, ())


def hub_cache_dir() -> Path:
    """The Hugging Face cache, read from the environment now (not at import) so tests and users can move it."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


SHARD_NAME = re.compile(r"(?P<stem>.+)-(?P<index>0*1)-of-(?P<total>\d+)(?P<suffix>\..+)")


def cached_path(source: WeightSource, cache_dir: Path | None = None) -> Path | None:
    """The cached copy of what `source.key` should point at, or None when any of its files is missing."""
    snapshot = _snapshot(source.repo, cache_dir or hub_cache_dir(), source.revision)
    if snapshot is None:
        return None
    for pattern in source.files:
        folder, _, name = pattern.rpartition("/")
        base = snapshot / folder if folder else snapshot
        if "*" not in name:
            if not (base / name).is_file():  # a link whose file a failed check removed is not a file
                return None
        elif not any(f.is_file() for f in base.glob(name)) or not _shards_complete(base):
            return None  # a folder or shards named by a pattern: there, and every shard an index names
        elif not all((snapshot / n).is_file() for n in pull_list(snapshot) if fnmatch.fnmatch(n, pattern)):
            return None  # a pull stopped inside the folder: files it listed are not there yet
    return snapshot / source.target if source.target else snapshot


def pull_list_path(snapshot: Path) -> Path:
    """Where `loom pull` writes, before fetching a folder, the names it lists there for this snapshot: beside
    the cache's refs and snapshots (which the hub's own tools read; they leave other folders alone)."""
    return snapshot.parent.parent / "loom-pulls" / f"{snapshot.name}.json"


def pull_list(snapshot: Path) -> list[str]:
    """The names `loom pull` set out to fetch into this snapshot (none when another tool fetched it)."""
    try:
        names = json.loads(pull_list_path(snapshot).read_text())
    except (OSError, ValueError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []


def _shards_complete(folder: Path) -> bool:
    """Every shard of a sharded model is there: each `NAME-00001-of-00005.EXT` has its four siblings, and each
    `*.index.json` finds every shard it names. A pull stopped between the shards leaves some, and the
    index (listed after them) often not yet: those must not pass for the whole model."""
    for first in folder.glob("*-00001-of-*"):
        match = SHARD_NAME.fullmatch(first.name)
        if match is not None:
            stem, total, suffix = match["stem"], match["total"], match["suffix"]
            if not all((folder / f"{stem}-{i:0{len(total)}d}-of-{total}{suffix}").is_file()
                       for i in range(1, int(total) + 1)):
                return False
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
        if not all((folder / shard).is_file() for shard in shards):
            return False
    return True


def _snapshot(repo: str, cache_dir: Path, revision: str = "main") -> Path | None:
    """The snapshot folder the cache's ref for `revision` points at (the revision `loom pull` fetches)."""
    repo_dir = cache_dir / f"models--{repo.replace('/', '--')}"
    ref = repo_dir / "refs" / revision
    if not ref.is_file():
        return None
    snapshot = repo_dir / "snapshots" / ref.read_text().strip()
    return snapshot if snapshot.is_dir() else None


def _get(cfg: Any, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _needs(cfg: Any, source: WeightSource) -> bool:
    """Whether the run reads this key: not given, and not replaced by random weights or another encoder."""
    if _get(cfg, source.key):
        return False
    if source.key == "model.checkpoint":
        return not cfg.model.random_weights
    if source.key == "vae.checkpoint":
        return not cfg.vae.random_weights and "wan" in (cfg.vae.encoder, cfg.vae.decoder)
    if source.key == "prompt.path":
        return cfg.prompt.encoder == "umt5"
    if source.key in ("edit.checkpoint", "edit.encoder_path"):
        return not cfg.model.random_weights and (source.key == "edit.checkpoint" or cfg.edit.encoder == "qwen3-vl")
    if source.key == "edit.lllite":
        return cfg.edit.lllite_hooks != "none"
    return True


def fill_pulled_weights(cfg: Any, cache_dir: Path | None = None) -> Any:
    """`cfg` with each needed, unset weight key pointed at its pulled copy (explicit paths win)."""
    sections: dict[str, dict[str, str]] = {}
    for source in weight_sources(cfg):
        if not _needs(cfg, source):
            continue
        path = cached_path(source, cache_dir)
        if path is not None:
            section, name = source.key.split(".")
            sections.setdefault(section, {})[name] = str(path)
    if not sections:
        return cfg
    return cfg.replace(**{s: replace(getattr(cfg, s), **values) for s, values in sections.items()})


def missing_weights(cfg: Any) -> list[str]:
    """One line per weight the run needs and has neither a path for nor a pulled copy of."""
    lines = []
    for source in weight_sources(cfg):
        if _needs(cfg, source) and not source.optional:
            lines.append(f"{source.key} ({source.what}, from {source.repo})")
    return lines
