"""Wan2.1-VACE: the Wan DiT with control blocks that steer it by structure (edges, depth, flow, grey).

The layout is Wan2.1-VACE's own (parameter names as in the released checkpoints; diffusers'
`WanVACETransformer3DModel` names are mapped in `dit_convert`): beside the main DiT, a second patch
embedding reads the control latents (`vace_in_channels`, 96 in the releases: the control video's
inactive and reactive VAE latents, 16 channels each, and its mask folded to 64 channels), and one
control block per entry of `vace_layers` runs the same transformer block as the main DiT. The first
control block adds a projection of the control tokens to the video tokens (`before_proj`); every
control block's output passes a projection (`after_proj`) to become a hint, and hint j, scaled by
`context_scale`, is added to the video tokens after main block `vace_layers[j]`.

The control blocks are ordinary blocks to the attention: over a full sequence they share the
main blocks' RoPE and mask, and streaming they keep their K/V in the same `KVCache`, under block
ids after the main ones, so sinks, window, pinned entries and RoPE refresh are planned once for
both. A reference image enters as one latent frame at timestep 0 before the video, committed and
pinned as the first sink (`ControlLatents.reference`): conditioning every later chunk, never denoised.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from loom_live.engine.cache.kv_cache import CrossKV, KVCache, StreamStep
from loom_live.engine.models.wan_dit import (
    CROSS_KV_LAYERS,
    Conditioning,
    FullSequenceAttention,
    SelfAttend,
    WanBlock,
    WanDiT,
    WanDiTConfig,
)
from loom_live.host_bridge.wire.params import TRAIN_TIMESTEPS

MASK_CHANNELS = 64  # the pixel mask folded 8x8 into channels at latent resolution
VAE_CHANNELS = 16


@dataclass(frozen=True)
class WanVaceConfig(WanDiTConfig):
    """A Wan DiT shape plus where its control blocks feed in. Defaults: the 1.3B VACE release."""

    vace_layers: tuple[int, ...] = tuple(range(0, 30, 2))
    vace_in_channels: int = 2 * VAE_CHANNELS + MASK_CHANNELS

    def __post_init__(self) -> None:
        super().__post_init__()
        layers = self.vace_layers
        if not layers or layers[0] != 0 or list(layers) != sorted(set(layers)) or layers[-1] >= self.num_layers:
            raise ValueError(f"vace_layers={list(layers)} must be ascending distinct block indices starting at 0 "
                             f"and below num_layers={self.num_layers}")
        if self.vace_in_channels < 1:
            raise ValueError(f"vace_in_channels={self.vace_in_channels} must be >= 1")


VACE_PRESETS: dict[str, WanVaceConfig] = {
    "wan2.1-vace-1.3b": WanVaceConfig(),
    "wan2.1-vace-14b": WanVaceConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40,
                                     vace_layers=tuple(range(0, 40, 5))),
    # tests and CPU runs: the tiny DiT with a control block at every other layer
    "tiny-vace": WanVaceConfig(dim=128, ffn_dim=512, num_heads=2, num_layers=4, vace_layers=(0, 2)),
}


class VaceBlock(WanBlock):
    """A control block: the DiT block itself, plus the projections in (first block only) and out."""

    def __init__(self, cfg: WanVaceConfig, first: bool) -> None:
        super().__init__(cfg)
        self.before_proj = nn.Linear(cfg.dim, cfg.dim) if first else None
        self.after_proj = nn.Linear(cfg.dim, cfg.dim)

    def run(
        self,
        c: torch.Tensor,
        x: torch.Tensor,
        mod: torch.Tensor,
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        self_attend: SelfAttend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hint, control tokens after this block) for control tokens c beside video tokens x."""
        if self.before_proj is not None:
            c = self.before_proj(c) + x
        c = self(c, mod, cross_k, cross_v, self_attend)
        return self.after_proj(c), c


@dataclass
class ControlLatents:
    """What the control branch reads, built by the stream (engine/stream/control.py) or a test."""

    latents: torch.Tensor  # [B, vace_in_channels, f, H, W], aligned frame by frame with the video latents
    scale: torch.Tensor | float = 1.0  # context_scale: a number, per row [B], or per row and frame [B, f]


def reference_entry(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference image as a conditioning entry: (video latent, control latent) of one frame.

    As in Wan2.1-VACE, the reference is the inactive part of its control frame (reactive part and
    mask zero); its video latent is the clean latent itself, at timestep 0."""
    if latent.ndim != 5 or latent.shape[1] != VAE_CHANNELS or latent.shape[2] != 1:
        raise ValueError(f"reference latent must be [B, {VAE_CHANNELS}, 1, H, W], got {tuple(latent.shape)}")
    zeros = latent.new_zeros(latent.shape[0], VAE_CHANNELS + MASK_CHANNELS, *latent.shape[2:])
    return latent, torch.cat((latent, zeros), dim=1)


class WanVaceDiT(WanDiT):
    """The Wan DiT with VACE control blocks. Parameters only; stream state lives in the `KVCache`."""

    cfg: WanVaceConfig

    def __init__(self, cfg: WanVaceConfig) -> None:
        super().__init__(cfg)
        self.vace_patch_embedding = nn.Conv3d(cfg.vace_in_channels, cfg.dim, kernel_size=cfg.patch_size,
                                              stride=cfg.patch_size)
        self.vace_blocks = nn.ModuleList(VaceBlock(cfg, first=j == 0) for j in range(len(cfg.vace_layers)))

    def control_block_ids(self) -> list[int]:
        """Cache and cross-K/V ids of the control blocks: after the main blocks'."""
        return [self.cfg.num_layers + j for j in range(len(self.vace_blocks))]

    # ----- pieces -----------------------------------------------------------------------
    def embed_control(self, control: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Control latents [B, vace_in_channels, F, H, W] to tokens [B, F*h*w, dim] on the video's grid."""
        got = self.token_grid(control, self.cfg.vace_in_channels, "control latents")
        if got != grid:
            raise ValueError(f"control latents give the token grid {got}; the video latents give {grid}: "
                             "control and video must have the same frames and size")
        param = self.vace_patch_embedding.weight
        return self.vace_patch_embedding(control.to(param.dtype)).flatten(2).transpose(1, 2).contiguous()

    def cross_kv_blocks(self, changed: Collection[str]) -> list[int] | None:
        """As `WanDiT.cross_kv_blocks`, with the control blocks' ids (`control_block_ids`) for theirs."""
        blocks = super().cross_kv_blocks(changed)
        if blocks is None:
            return None
        control = {self.cfg.num_layers + int(name.split(".")[1]) for name in changed
                   if name.startswith("vace_blocks.") and name.endswith(CROSS_KV_LAYERS)}
        return sorted({*blocks, *control})

    def cross_kv(self, context: torch.Tensor, blocks: Sequence[int] | None = None) -> CrossKV:
        """Cross K/V of the given blocks, main and control (`control_block_ids`); default every one."""
        n = self.cfg.num_layers
        main = super().cross_kv(context, None if blocks is None else [i for i in blocks if i < n])
        control = self.control_block_ids() if blocks is None else [i for i in blocks if i >= n]
        if not control:
            return main
        param = self.text_embedding[0].weight
        if context.shape[1] < self.cfg.text_len:
            context = nn.functional.pad(context, (0, 0, 0, self.cfg.text_len - context.shape[1]))
        emb = self.text_embedding(context.to(param.dtype))
        for i in control:
            main.k[i], main.v[i] = self.vace_blocks[i - n].cross_attn.kv(emb)
        return main

    def hints(
        self, tokens: torch.Tensor, control: ControlLatents, grid: tuple[int, int, int], cond: Conditioning,
        cross: CrossKV, self_attend: SelfAttend,
    ) -> dict[int, torch.Tensor]:
        """The scaled hint of every control block, by the main block it follows."""
        c = self.embed_control(control.latents, grid)
        scale = _token_scale(control.scale, tokens, grid)
        out = {}
        for j, (block, i) in enumerate(zip(self.vace_blocks, self.control_block_ids())):
            hint, c = block.run(c, tokens, cond.mod, cross.k[i], cross.v[i],
                                lambda q, k, v, i=i: self_attend(i, q, k, v))
            out[self.cfg.vace_layers[j]] = hint * scale
        return out

    # ----- whole passes -----------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        context: torch.Tensor,
        block_causal_frames: int | Sequence[int] | None = None,
        control: ControlLatents | None = None,
    ) -> torch.Tensor:
        """Flow prediction for a whole clip with its control latents (see `WanDiT.forward`)."""
        if control is None:
            raise ValueError("a VACE model needs control latents (ControlLatents) with the video latents")
        tokens, cond, grid = self.embed(x, timestep)
        attend = FullSequenceAttention(self.rope(tokens.device), grid, block_causal_frames)
        cross = self.cross_kv(context)
        hints = self.hints(tokens, control, grid, cond, cross, attend)
        tokens = self.run_blocks(0, self.cfg.num_layers, tokens, cond, cross, attend, hints)
        return self.head(tokens, cond, grid, x, timestep / TRAIN_TIMESTEPS)

    def new_cache(self, batch: int, frame_shape: tuple[int, int], *args: object,
                  blocks: Sequence[int] | None = None, **kwargs: object) -> KVCache:
        """A KV cache for the main blocks (default all) and every control block."""
        ids = list(range(self.cfg.num_layers) if blocks is None else blocks) + self.control_block_ids()
        return super().new_cache(batch, frame_shape, *args, blocks=ids, **kwargs)

    def stream_step(self, x: torch.Tensor, timestep: torch.Tensor, cache: KVCache, cross: CrossKV,
                    step: StreamStep, control: torch.Tensor | None = None,
                    context_scale: torch.Tensor | float = 1.0) -> torch.Tensor:
        """The device work of one planned chunk (see `WanDiT.stream_step`) with its control latents
        [B, vace_in_channels, f, H, W]: control blocks first, then the main blocks with their hints."""
        if control is None:
            raise ValueError("a VACE model needs the chunk's control latents (control=...)")
        tokens, cond, grid = self.embed(x, timestep)
        attend = cache.attention(step, self.ops.cache)
        hints = self.hints(tokens, ControlLatents(control, context_scale), grid, cond, cross, attend)
        tokens = self.run_blocks(0, self.cfg.num_layers, tokens, cond, cross, attend, hints)
        return self.head(tokens, cond, grid, x, timestep / TRAIN_TIMESTEPS)


def _token_scale(scale: torch.Tensor | float, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """context_scale as a factor broadcastable to tokens [B, F*h*w, dim]."""
    s = torch.as_tensor(scale, device=tokens.device, dtype=tokens.dtype)
    if s.ndim == 0:
        return s
    b, f = tokens.shape[0], grid[0]
    if s.ndim == 1 and s.shape[0] == b:
        return s[:, None, None]
    if s.ndim == 2 and s.shape == (b, f):
        return s.repeat_interleave(grid[1] * grid[2], dim=1)[:, :, None]
    raise ValueError(f"context_scale must be a number, [{b}] or [{b}, {f}], got {tuple(s.shape)}")


def vace_preset(name: str, **overrides: object) -> WanVaceConfig:
    """A VACE preset config by name, optionally with fields replaced."""
    if name not in VACE_PRESETS:
        raise ValueError(f"unknown VACE preset {name!r}; allowed: {', '.join(VACE_PRESETS)}")
    return replace(VACE_PRESETS[name], **overrides)
