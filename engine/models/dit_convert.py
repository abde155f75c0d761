"""Checkpoint key layouts of the Wan2.1 DiT, mapped onto `WanDiT`'s parameter names.

`WanDiT` uses Wan2.1's original names, so those load as they are. Also accepted:
- diffusers `WanTransformer3DModel` (condition_embedder.*, attn1/attn2, to_q.., proj_out,
  scale_shift_table; its block `norm2` is Wan's cross-attention `norm3`);
- CausVid / StreamDiffusionV2 generators (`model.pt` whose `generator` / `generator_ema` dict,
  unwrapped by checkpoint_io, holds Wan keys under a `model.` prefix);
- ComfyUI-style single files with a `model.diffusion_model.` prefix;
- the VACE layout (engine/models/wan_vace.py): Wan2.1-VACE's `vace_patch_embedding` and
  `vace_blocks.N.` (blocks with `before_proj` / `after_proj`), diffusers' `WanVACETransformer3DModel`
  (the same blocks with `proj_in` / `proj_out`).
Every key is translated on its own (the two layouts never share a name for different tensors),
so no global format guess is needed; keys of anything else end up as unexpected keys.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files, load_into_module

LAYOUTS = ("Wan2.1 original, diffusers WanTransformer3DModel, CausVid/StreamDiffusionV2 generator, "
           "Wan2.1-VACE, diffusers WanVACETransformer3DModel")
BLOCK_LISTS = ("blocks", "vace_blocks")
PREFIXES = ("model.diffusion_model.", "model.")
WEIGHT_BIAS = ("weight", "bias")


def _top_level() -> dict[str, str]:
    pairs = {
        "patch_embedding": "patch_embedding",
        "text_embedding.0": "condition_embedder.text_embedder.linear_1",
        "text_embedding.2": "condition_embedder.text_embedder.linear_2",
        "time_embedding.0": "condition_embedder.time_embedder.linear_1",
        "time_embedding.2": "condition_embedder.time_embedder.linear_2",
        "time_projection.1": "condition_embedder.time_proj",
        "head.head": "proj_out",
        "vace_patch_embedding": "vace_patch_embedding",
    }
    names = {f"{w}.{s}": f"{d}.{s}" for w, d in pairs.items() for s in WEIGHT_BIAS}
    names["head.modulation"] = "scale_shift_table"
    return names


def _in_block() -> dict[str, str]:
    names = {"modulation": "scale_shift_table"}
    for wan, hf in (("self_attn", "attn1"), ("cross_attn", "attn2")):
        for proj, hf_proj in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0")):
            names.update({f"{wan}.{proj}.{s}": f"{hf}.{hf_proj}.{s}" for s in WEIGHT_BIAS})
        names.update({f"{wan}.{n}.weight": f"{hf}.{n}.weight" for n in ("norm_q", "norm_k")})
    for wan, hf in (("norm3", "norm2"), ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"),
                    ("before_proj", "proj_in"), ("after_proj", "proj_out")):  # the last two: VACE blocks
        names.update({f"{wan}.{s}": f"{hf}.{s}" for s in WEIGHT_BIAS})
    return names


WAN_TO_DIFFUSERS_TOP = _top_level()
WAN_TO_DIFFUSERS_BLOCK = _in_block()
DIFFUSERS_TO_WAN_TOP = {v: k for k, v in WAN_TO_DIFFUSERS_TOP.items()}
DIFFUSERS_TO_WAN_BLOCK = {v: k for k, v in WAN_TO_DIFFUSERS_BLOCK.items()}


def _split_block(key: str) -> tuple[str, str]:
    """'blocks.3.ffn.0.weight' -> ('blocks.3.', 'ffn.0.weight') (and 'vace_blocks.N.'); other keys ->
    ('', key)."""
    parts = key.split(".", 2)
    if len(parts) == 3 and parts[0] in BLOCK_LISTS and parts[1].isdigit():
        return f"{parts[0]}.{parts[1]}.", parts[2]
    return "", key


def to_wan_key(key: str) -> str | None:
    """Translate one checkpoint key of any accepted layout to WanDiT's name (unknown keys are
    returned stripped but otherwise unchanged, so they are reported as unexpected)."""
    for prefix in PREFIXES:
        if key.startswith(prefix):
            key = key[len(prefix) :]
            break
    block, rest = _split_block(key)
    table = DIFFUSERS_TO_WAN_BLOCK if block else DIFFUSERS_TO_WAN_TOP
    return block + table.get(rest, rest)


def to_diffusers_key(key: str) -> str:
    """WanDiT / Wan2.1 name -> diffusers WanTransformer3DModel name."""
    block, rest = _split_block(key)
    table = WAN_TO_DIFFUSERS_BLOCK if block else WAN_TO_DIFFUSERS_TOP
    if rest not in table:
        raise KeyError(f"{key!r} is not a Wan2.1 DiT parameter name")
    return block + table[rest]


def is_wan_key(key: str) -> bool:
    block, rest = _split_block(key)
    return rest in (WAN_TO_DIFFUSERS_BLOCK if block else WAN_TO_DIFFUSERS_TOP)


def block_filter(blocks: range | None) -> callable:
    """`keep` predicate for load_into_module: everything outside blocks, plus the given blocks."""

    def keep(name: str) -> bool:
        if blocks is None or not name.startswith("blocks."):
            return True
        return int(name.split(".", 2)[1]) in blocks

    return keep


def load_dit_weights(
    model: nn.Module,
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    blocks: range | None = None,
) -> None:
    """Load a checkpoint of any accepted layout into a (meta-built) WanDiT, strictly."""
    files = checkpoint_files(_transformer_dir(Path(path).expanduser()))
    seen = recognised = 0

    def rename(key: str) -> str | None:
        nonlocal seen, recognised
        name = to_wan_key(key)
        seen += 1
        recognised += is_wan_key(name)
        return name

    try:
        load_into_module(model, files, rename, device=device, dtype=dtype, keep=block_filter(blocks))
    except CheckpointError as exc:
        if seen and recognised == 0:  # keys read, none of a DiT (a file that cannot be read says so alone)
            raise CheckpointError(
                f"unknown checkpoint format: no key is a Wan2.1 DiT key in any accepted "
                f"layout ({LAYOUTS}); {exc}"
            ) from exc
        raise


def _transformer_dir(path: Path) -> Path:
    """A diffusers pipeline folder keeps the DiT in transformer/; accept the folder itself too."""
    sub = path / "transformer"
    return sub if path.is_dir() and sub.is_dir() else path
