"""The edit UNet's architecture, read from a diffusers `DreamLiteUNetModel` config.json.

DreamLite's UNet is described by the same keys as diffusers' UNet2DConditionModel plus a few of
its own (`use_sep_conv`, `qk_norm`, `num_kv_heads`, `ff_mult`, `num_mid_layers`). A released
checkpoint's `unet/config.json` is parsed here into `EditUNetConfig`; a key Loom does not
implement (dual cross-attention, class embeddings, scale-shift resnets, ...) is refused by name
rather than silently built differently. diffusers' `attention_head_dim` is, for historical
reasons, the number of heads per level (head width = channels / heads); it is read as such.

The `dreamlite-mobile` preset holds the released DreamLite UNet's values. Source: the authors'
inference code builds its UNet from `modules/dreamlite.json` (github.com/ByteVisionLab/DreamLite,
read through the mirror github.com/jamesanto/DreamLite at commit ec90f51); DreamLite-base and
DreamLite-mobile share this architecture (both 0.39B; mobile is step-distilled). Checks: 389.97M
parameters, and 108 LLLite hook points of which 38 in the down blocks, the counts the temporal
LLLite release (otanl/dreamlite-stream) reports. The hub's `unet/config.json` of
carlofkl/DreamLite-mobile could not be read from here; a checkpoint directory's own config.json
is read at load time and wins (engine/edit/checkpoint.py), so a difference would show there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# diffusers block names (DreamLite's and the upstream aliases its configs use) -> Loom's kind
DOWN_KINDS = {"DreamLiteCrossAttnDownBlock2D": "cross", "CrossAttnDownBlock2D": "cross",
              "DreamLiteCrossAttnNoSelfAttnDownBlock2D": "cross_only",
              "CrossAttnDownRemoveSelfAttnBlock2D": "cross_only",
              "DreamLiteDownBlock2D": "plain", "DownBlock2D": "plain"}
UP_KINDS = {"DreamLiteCrossAttnUpBlock2D": "cross", "CrossAttnUpBlock2D": "cross",
            "DreamLiteCrossAttnNoSelfAttnUpBlock2D": "cross_only",
            "CrossAttnUpRemoveSelfAttnBlock2D": "cross_only", "CrossAttnUpRemoveSelfAttnBlock2DV1": "cross_only",
            "DreamLiteUpBlock2D": "plain", "UpBlock2D": "plain"}
MID_KINDS = ("DreamLiteUNetMidBlock2DCrossAttn", "UNetMidBlock2DCrossAttn")
# the `_class_name` of DreamLite's UNet config (diffusers' class, and the authors' modules/dreamlite.json)
DREAMLITE_CLASS = "DreamLiteUNetModel"

# keys whose value must be the one Loom implements: key -> allowed values
FIXED = {
    "center_input_sample": (False,), "class_embed_type": (None,), "num_class_embeds": (None,),
    "class_embeddings_concat": (False,), "dual_cross_attention": (False,), "only_cross_attention": (False,),
    "mid_block_only_cross_attention": (None, False), "resnet_time_scale_shift": ("default",),
    "resnet_skip_time_act": (False,), "resnet_out_scale_factor": (1, 1.0), "time_embedding_type": ("positional",),
    "time_embedding_act_fn": (None,), "timestep_post_act": (None,), "time_cond_proj_dim": (None,),
    "attention_type": ("default",), "cross_attention_norm": (None,), "upcast_attention": (None, False),
    "act_fn": ("silu",), "dropout": (0, 0.0), "downsample_padding": (1,), "num_attention_heads": (None,),
    "encoder_hid_dim_type": (None, "text_proj_rms"), "addition_embed_type": (None, "time"),
    "qk_norm": (None, "rms_norm"), "conv_in_kernel": (3,), "conv_out_kernel": (3,),
}


@dataclass(frozen=True)
class EditUNetConfig:
    """One entry per resolution level in `channels`, `heads`, `depth`, `down`, `up` (up block i works at
    level n-1-i). `depth[i]` is transformer blocks per attention at level i; `up_depth` overrides the up
    blocks' (diffusers' reverse_transformer_layers_per_block)."""

    channels: tuple[int, ...]
    down: tuple[str, ...]  # "cross" (self + cross-attention), "cross_only", "plain" (resnets only)
    up: tuple[str, ...]
    layers_per_block: tuple[int, ...]
    depth: tuple[int, ...]
    heads: tuple[int, ...]
    kv_heads: int | None  # None: as many as query heads
    qk_norm: bool  # RMSNorm on each head of q and k
    cross_dim: int
    context_dim: int | None  # None: the context goes to cross-attention unprojected
    ff_mult: int
    mid_layers: int
    mid_scale: float
    sep_conv: bool  # depthwise-separable resnet convolutions, expanding 2x in between
    linear_projection: bool  # transformer in/out projections: Linear (else 1x1 Conv)
    time_ids_dim: int | None  # None: no (width, height) embedding
    time_ids_proj: int
    time_dim: int | None  # None: 4 x channels[0]
    flip_sin_to_cos: bool
    freq_shift: float
    norm_groups: int
    norm_eps: float
    up_depth: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.channels)
        for name in ("down", "up", "layers_per_block", "depth", "heads"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"unet config: {name} needs one entry per level ({n}), got {getattr(self, name)}")
        for c, h in zip(self.channels, self.heads):
            if c % h or c % self.norm_groups:
                raise ValueError(f"unet config: {c} channels must be a multiple of its {h} heads and of "
                                 f"norm_num_groups {self.norm_groups}")
            if self.kv_heads is not None and h % self.kv_heads:
                raise ValueError(f"unet config: {h} heads must be a multiple of num_kv_heads {self.kv_heads}")

    @property
    def temb_dim(self) -> int:
        return self.time_dim or 4 * self.channels[0]

    @property
    def context_in(self) -> int:
        """Width of the conditioning tokens the UNet takes."""
        return self.context_dim or self.cross_dim

    @property
    def downscale(self) -> int:
        """Latent-to-feature factor at the lowest level."""
        return 2 ** (len(self.channels) - 1)

    def up_depths(self, i: int) -> tuple[int, ...]:
        """Transformer blocks of each attention of up block i."""
        if self.up_depth is not None:
            return self.up_depth[i]
        level = len(self.channels) - 1 - i
        return (self.depth[level],) * (self.layers_per_block[level] + 1)

    @classmethod
    def from_diffusers(cls, config: dict[str, Any], where: str = "unet config") -> EditUNetConfig:
        """Parse a diffusers DreamLiteUNetModel config; refuses what Loom does not build, naming the key."""
        c = dict(config)
        for key, allowed in FIXED.items():
            if key in c and c[key] not in allowed:
                raise ValueError(f"{where}: {key}={c[key]!r} is not supported; allowed: "
                                 f"{', '.join(repr(a) for a in allowed)}")
        channels = tuple(c.get("block_out_channels", (320, 640, 1280)))
        n = len(channels)
        down = tuple(_kind(DOWN_KINDS, t, "down_block_types", where) for t in c.get("down_block_types", ()))
        up = tuple(_kind(UP_KINDS, t, "up_block_types", where) for t in c.get("up_block_types", ()))
        if c.get("mid_block_type", MID_KINDS[0]) not in MID_KINDS:
            raise ValueError(f"{where}: mid_block_type={c['mid_block_type']!r} is not supported; allowed: "
                             f"{', '.join(MID_KINDS)}")
        if (c.get("in_channels", 4), c.get("out_channels", 4)) != (4, 4):
            raise ValueError(f"{where}: in_channels/out_channels must be 4 (the tiny autoencoder's latents)")
        up_depth = c.get("reverse_transformer_layers_per_block")
        hid_type, add_type = c.get("encoder_hid_dim_type"), c.get("addition_embed_type")
        cross = c.get("cross_attention_dim", 2048)
        if isinstance(cross, (list, tuple)):
            if len(set(cross)) != 1:
                raise ValueError(f"{where}: cross_attention_dim must be the same at every level, got {cross}")
            cross = cross[0]
        return cls(
            channels=channels, down=down, up=up,
            layers_per_block=_per_level(c.get("layers_per_block", 2), n),
            depth=_per_level(c.get("transformer_layers_per_block", 1), n),
            heads=_per_level(c.get("attention_head_dim", 64), n),
            kv_heads=c.get("num_kv_heads", 1), qk_norm=c.get("qk_norm", "rms_norm") == "rms_norm",
            cross_dim=cross, context_dim=c.get("encoder_hid_dim") if hid_type else None,
            ff_mult=c.get("ff_mult", 6), mid_layers=c.get("num_mid_layers", 1),
            mid_scale=float(c.get("mid_block_scale_factor", 1.0)), sep_conv=c.get("use_sep_conv", True),
            linear_projection=c.get("use_linear_projection", False),
            time_ids_dim=c.get("addition_time_embed_dim") if add_type else None,
            time_ids_proj=c.get("projection_class_embeddings_input_dim") or 0,
            time_dim=c.get("time_embedding_dim"), flip_sin_to_cos=c.get("flip_sin_to_cos", True),
            freq_shift=float(c.get("freq_shift", 0)), norm_groups=c.get("norm_num_groups", 32),
            norm_eps=c.get("norm_eps", 1e-5), up_depth=tuple(tuple(d) for d in up_depth) if up_depth else None)

    @classmethod
    def from_file(cls, path: str | Path) -> EditUNetConfig:
        try:
            config = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable UNet config.json ({exc})") from exc
        if not isinstance(config, dict):
            raise ValueError(f"{path}: not a UNet config.json (a JSON object of the model's settings)")
        named = config.get("_class_name")
        # another diffusers UNet (SD1.5's UNet2DConditionModel) shares most keys and its block names: read as
        # DreamLite's, it was refused only by its weights, after a warning that it "describes another UNet"
        if isinstance(named, str) and "DreamLite" not in named:
            raise ValueError(f"{path}: _class_name {named!r} is not DreamLite's UNet (expected {DREAMLITE_CLASS!r}); "
                             "give a DreamLite checkpoint (`loom pull dreamlite-edit`)")
        try:
            return cls.from_diffusers(config, str(path))
        except (TypeError, ValueError) as exc:  # the file named, whichever check refused it
            words = str(exc).removeprefix("unet config: ")
            raise ValueError(words if words.startswith(str(path)) else f"{path}: {words}") from None


def _kind(kinds: dict[str, str], name: str, key: str, where: str) -> str:
    if name not in kinds:
        raise ValueError(f"{where}: {key} entry {name!r} is not supported; allowed: {', '.join(kinds)}")
    return kinds[name]


def _per_level(value: int | list[int], n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,) * n


# The released DreamLite UNet (DreamLite-mobile and -base), in diffusers' keys; source in the module docstring.
DREAMLITE_MOBILE: dict[str, Any] = {
    "block_out_channels": [256, 512, 896], "layers_per_block": 2, "transformer_layers_per_block": [1, 2, 4],
    "attention_head_dim": [4, 8, 14], "num_kv_heads": 1, "qk_norm": "rms_norm", "ff_mult": 3,
    "down_block_types": ["CrossAttnDownRemoveSelfAttnBlock2D", "CrossAttnDownRemoveSelfAttnBlock2D",
                         "CrossAttnDownBlock2D"],
    "mid_block_type": "UNetMidBlock2DCrossAttn", "num_mid_layers": 1,
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpRemoveSelfAttnBlock2DV1", "UpBlock2D"],
    "cross_attention_dim": 2304, "encoder_hid_dim": 2048, "encoder_hid_dim_type": "text_proj_rms",
    "addition_embed_type": "time", "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 512,
    "use_linear_projection": True, "use_sep_conv": True, "flip_sin_to_cos": True, "freq_shift": 0,
    "norm_num_groups": 32, "norm_eps": 1e-5, "in_channels": 4, "out_channels": 4, "sample_size": 128,
}

# small enough to compile in seconds on a CPU: separable resnets, a cross-only block in the down
# path and a full one in the middle (hooks inside and outside the down blocks)
TINY: dict[str, Any] = {
    **DREAMLITE_MOBILE, "block_out_channels": [16, 32], "transformer_layers_per_block": [1, 1],
    "attention_head_dim": [2, 4], "down_block_types": ["CrossAttnDownRemoveSelfAttnBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "UpBlock2D"], "layers_per_block": 1, "cross_attention_dim": 16,
    "encoder_hid_dim": 24, "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 16,
    "norm_num_groups": 4, "ff_mult": 2,
}

UNET_PRESETS: dict[str, EditUNetConfig] = {
    "dreamlite-mobile": EditUNetConfig.from_diffusers(DREAMLITE_MOBILE, "dreamlite-mobile preset"),
    "tiny": EditUNetConfig.from_diffusers(TINY, "tiny preset"),
}
