"""Checkpoint key names for the Wan2.1 VAE: original `Wan2.1_VAE.pth` <-> Loom (= diffusers).

Loom's `WanVAE` uses diffusers' `AutoencoderKLWan` parameter names, so diffusers files load
as they are. The original Wan2.1 release names modules by position inside nn.Sequential
containers; the differences are:

- top level: `conv1` / `conv2` are `quant_conv` / `post_quant_conv`;
- `encoder.conv1`, `decoder.conv1` are the `conv_in` layers; `head.0` / `head.2` are
  `norm_out` / `conv_out`; `middle.0/1/2` are `mid_block.resnets.0`, `attentions.0`, `resnets.1`;
- residual blocks: `residual.0` norm1, `residual.2` conv1, `residual.3` norm2, `residual.6`
  conv2, `shortcut` conv_shortcut;
- the encoder's flat `downsamples.N` list is `down_blocks.N` (same order);
- the decoder's flat `upsamples.N` list is grouped per level: `num_res_blocks + 1` residual
  blocks then one resampler, i.e. `up_blocks.L.resnets.J` and `up_blocks.L.upsamplers.0`.
"""

from __future__ import annotations

import re
from typing import Protocol


class VAELayout(Protocol):
    """What the key mapping needs of a VAE's config (`WanVAEConfig` has it): the model imports this
    module to load checkpoints, so this module names the shape it reads rather than the model."""

    dim_mult: tuple[int, ...]
    num_res_blocks: int

_TOP = {"conv1.": "quant_conv.", "conv2.": "post_quant_conv."}
_HEAD = {"head.0.": "norm_out.", "head.2.": "conv_out.", "conv1.": "conv_in."}
_MIDDLE = {"0": "mid_block.resnets.0.", "1": "mid_block.attentions.0.", "2": "mid_block.resnets.1."}
_RESIDUAL = {"residual.0.": "norm1.", "residual.2.": "conv1.", "residual.3.": "norm2.",
             "residual.6.": "conv2.", "shortcut.": "conv_shortcut."}
_ORIGINAL_MARKERS = ("encoder.downsamples.", "decoder.upsamples.", "encoder.middle.", "decoder.middle.",
                     "encoder.head.", "decoder.head.", "encoder.conv1.", "decoder.conv1.")


def _decoder_layout(cfg: VAELayout) -> list[str]:
    """Native prefix of each entry of the original decoder's flat `upsamples` list."""
    layout = []
    for level in range(len(cfg.dim_mult)):
        layout += [f"up_blocks.{level}.resnets.{j}." for j in range(cfg.num_res_blocks + 1)]
        if level < len(cfg.dim_mult) - 1:
            layout.append(f"up_blocks.{level}.upsamplers.0.")
    return layout


def _swap_prefix(rest: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        if rest.startswith(old):
            return new + rest[len(old):]
    return rest


def original_to_native(key: str, cfg: VAELayout) -> str:
    """Map one original Wan2.1 key to Loom's name; keys that are not original-format pass unchanged."""
    part, _, rest = key.partition(".")
    if part not in ("encoder", "decoder"):
        return _swap_prefix(key, _TOP)
    m = re.match(r"(downsamples|upsamples|middle)\.(\d+)\.(.*)", rest)
    if m is None:
        return f"{part}.{_swap_prefix(rest, _HEAD)}"
    group, index, inner = m.group(1), int(m.group(2)), m.group(3)
    inner = _swap_prefix(inner, _RESIDUAL)
    if group == "middle":
        return f"{part}.{_MIDDLE[str(index)]}{inner}" if str(index) in _MIDDLE else key
    if group == "downsamples":
        return f"{part}.down_blocks.{index}.{inner}"
    layout = _decoder_layout(cfg)
    return f"{part}.{layout[index]}{inner}" if index < len(layout) else key


def native_to_original(key: str, cfg: VAELayout) -> str:
    """Map one Loom (diffusers) key to the original Wan2.1 name (the inverse of `original_to_native`)."""
    part, _, rest = key.partition(".")
    if part not in ("encoder", "decoder"):
        return _swap_prefix(key, {v: k for k, v in _TOP.items()})
    inverse_residual = {v: k for k, v in _RESIDUAL.items()}
    for index, prefix in _MIDDLE.items():
        if rest.startswith(prefix):
            return f"{part}.middle.{index}.{_swap_prefix(rest[len(prefix):], inverse_residual)}"
    m = re.match(r"down_blocks\.(\d+)\.(.*)", rest)
    if m:
        return f"{part}.downsamples.{m.group(1)}.{_swap_prefix(m.group(2), inverse_residual)}"
    for index, prefix in enumerate(_decoder_layout(cfg)):
        if rest.startswith(prefix):
            return f"{part}.upsamples.{index}.{_swap_prefix(rest[len(prefix):], inverse_residual)}"
    return f"{part}.{_swap_prefix(rest, {v: k for k, v in _HEAD.items()})}"


def is_original_key(key: str) -> bool:
    return key.startswith(_ORIGINAL_MARKERS) or key.startswith(tuple(_TOP))


def wan_key_to_native(key: str, cfg: VAELayout) -> str:
    """Accept original and diffusers names alike (they never collide)."""
    return original_to_native(key, cfg) if is_original_key(key) else key


def guess_checkpoint_kind(keys: list[str]) -> str | None:
    """Name the model a foreign checkpoint most likely belongs to, for error messages."""
    joined = "\n".join(keys[:2000])
    dit_block = re.search(r"^(model\.)?blocks\.\d+\.(self_attn|cross_attn)", joined, re.M)
    if "patch_embedding" in joined or dit_block:
        return "a Wan DiT (transformer)"
    if re.search(r"^(encoder|decoder)\.\d+\.conv\.\d\.weight", joined, re.M):
        return "a TAEHV tiny VAE (use the tiny VAE option, engine.models.taehv.TinyVAE)"
    if any(is_original_key(k) for k in keys) or "encoder.down_blocks." in joined:
        return "a Wan2.1 VAE (use engine.models.wan_vae.WanVAE)"
    if re.search(r"(text_model|shared\.weight|encoder\.block\.\d+)", joined):
        return "a text encoder"
    return None


def explain_mismatch(message: str, keys: list[str], expected: str) -> str:
    """Add a plain-words guess of what the file is to a strict-loading error."""
    kind = guess_checkpoint_kind(keys)
    if kind is None or kind.startswith(expected):
        return message
    return f"{message}. This file is not {expected} checkpoint; its keys look like {kind}"
