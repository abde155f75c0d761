"""The edit denoiser: a DreamLite-mobile-style pruned UNet with grouped-query attention.

Editing works by in-context spatial concatenation: the noisy target latent and the source
latent sit side by side along the width, [B, 4, h, 2w], and every layer sees both; the output's
left half is the prediction for the target. Conditioning is the vision-language model's last
hidden state (2048-d), projected once to the cross-attention width.

Attention has one key/value head shared by all query heads (GQA with a single KV head) and
RMSNorm on q and k. With one KV head every query head attends to the same keys, so the heads are
folded into the query sequence and attention runs as one head over H*N queries: the same result
as repeating K/V H times, without materialising the repeats.

Module and parameter names follow the diffusers UNet layout the released weights use
(`down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight`, ...), so loading needs no
renaming. Each attention projection the LLLite adapter may hook is named by that same path; the
UNet asks the adapter (state kept outside the model) for the shifted input at each hook point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

HOOK_PROJECTIONS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q")


@dataclass(frozen=True)
class EditUNetConfig:
    """Architecture of the edit UNet: one resolution level per entry of `channels`.

    `down_depths[i][j]` is the number of transformer blocks after resnet j of down level i (0: no
    attention there); `up_depths[i]` likewise for up block i (which mirrors level n-1-i, with
    layers_per_block + 1 resnets). `self_attention[i]` says whether transformer blocks at level i
    have self-attention (attn1) or only cross-attention: the highest resolution skips the
    quadratic self-attention.
    """

    in_channels: int = 4
    channels: tuple[int, ...] = (256, 512, 768)
    layers_per_block: int = 2
    down_depths: tuple[tuple[int, ...], ...] = ((1, 1), (1, 1), (4, 3))
    mid_depth: int = 2
    up_depths: tuple[tuple[int, ...], ...] = ((4, 4, 3), (1, 1, 1), (2, 2, 2))
    self_attention: tuple[bool, ...] = (False, True, True)
    head_dim: int = 64
    kv_heads: int = 1
    cross_dim: int = 1024
    context_dim: int = 2048
    ff_mult: int = 4
    norm_groups: int = 32
    time_ids: int = 2  # (width, height) of the target, embedded like the timestep

    def __post_init__(self) -> None:
        n = len(self.channels)
        if len(self.down_depths) != n or len(self.up_depths) != n or len(self.self_attention) != n:
            raise ValueError(f"down_depths, up_depths and self_attention need one entry per level ({n})")
        if any(len(d) != self.layers_per_block for d in self.down_depths):
            raise ValueError(f"down_depths: each level needs {self.layers_per_block} entries")
        if any(len(d) != self.layers_per_block + 1 for d in self.up_depths):
            raise ValueError(f"up_depths: each up block needs {self.layers_per_block + 1} entries")
        if any(c % self.head_dim or c % self.norm_groups for c in self.channels):
            raise ValueError(f"channels {self.channels} must be multiples of head_dim and norm_groups")

    @property
    def time_dim(self) -> int:
        return self.channels[0] * 4

    @property
    def downscale(self) -> int:
        """Latent-to-feature factor at the lowest level."""
        return 2 ** (len(self.channels) - 1)


UNET_PRESETS: dict[str, EditUNetConfig] = {
    # DreamLite-mobile at the published scale: 108 adapter hook points, 38 of them in the down
    # blocks, about 0.39B parameters. The released config.json was not available to read, so the
    # block layout is chosen to match those published counts; the strict loader names any
    # difference from a real checkpoint key by key.
    "dreamlite-mobile": EditUNetConfig(),
    # small enough to compile in seconds on a CPU, with every kind of block: cross-only and full
    # attention, resnets with and without a transformer, hooks inside and outside the down blocks
    "tiny": EditUNetConfig(channels=(16, 32), layers_per_block=1, down_depths=((1,), (0,)), mid_depth=1,
                           up_depths=((0, 0), (1, 0)), self_attention=(False, True), head_dim=8,
                           cross_dim=16, context_dim=24, ff_mult=2, norm_groups=4),
}


class Adapter(Protocol):
    """Shifts the input of a hooked attention projection (the LLLite adapter)."""

    def shift(self, key: str, x: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    """Multi-query attention: `heads` query heads, `kv_heads` key/value heads, RMSNorm on q and k."""

    def __init__(self, dim: int, kv_in: int, head_dim: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim, self.kv_heads = dim // head_dim, head_dim, kv_heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(kv_in, kv_heads * head_dim, bias=False)
        self.to_v = nn.Linear(kv_in, kv_heads * head_dim, bias=False)
        self.norm_q = RMSNorm(head_dim)
        self.norm_k = RMSNorm(head_dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])

    def forward(self, xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, _ = xq.shape
        h, d, g = self.heads, self.head_dim, self.kv_heads
        q = self.norm_q(self.to_q(xq).view(b, n, g, h // g, d))  # query heads grouped by their KV head
        k = self.norm_k(self.to_k(xk).view(b, -1, g, d)).transpose(1, 2)
        v = self.to_v(xv).view(b, -1, g, d).transpose(1, 2)
        q = q.permute(0, 2, 3, 1, 4).reshape(b, g, (h // g) * n, d)  # fold heads into the query sequence
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.view(b, g, h // g, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, h * d)
        return self.to_out[0](out)


class FeedForward(nn.Module):
    """GEGLU feed-forward (diffusers names: net.0.proj, net.2)."""

    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = dim * mult
        self.net = nn.ModuleList([_Proj(dim, inner * 2), nn.Identity(), nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, gate = self.net[0].proj(x).chunk(2, dim=-1)
        return self.net[2](a * F.gelu(gate))


class _Proj(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, out)


class TransformerBlock(nn.Module):
    """Self-attention (optional), cross-attention to the VLM tokens, GEGLU; pre-LayerNorm."""

    def __init__(self, key: str, dim: int, cfg: EditUNetConfig, self_attention: bool) -> None:
        super().__init__()
        self.keys = {p: f"{key}.{p}" for p in HOOK_PROJECTIONS}
        self.norm1 = nn.LayerNorm(dim) if self_attention else None
        self.attn1 = Attention(dim, dim, cfg.head_dim, cfg.kv_heads) if self_attention else None
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, cfg.cross_dim, cfg.head_dim, cfg.kv_heads)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, cfg.ff_mult)

    def hook_points(self) -> list[str]:
        return [k for p, k in self.keys.items() if self.attn1 is not None or not p.startswith("attn1")]

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None,
                adapter: Adapter | None) -> torch.Tensor:
        if self.attn1 is not None:
            h = self.norm1(x)
            q = k = v = h
            if adapter is not None:
                q, k, v = (adapter.shift(self.keys[p], h) for p in HOOK_PROJECTIONS[:3])
            x = x + self.attn1(q, k, v)
        h = self.norm2(x)
        q = adapter.shift(self.keys["attn2.to_q"], h) if adapter is not None else h
        x = x + self.attn2(q, ctx, ctx, mask)
        return x + self.ff(self.norm3(x))


class SpatialTransformer(nn.Module):
    """GroupNorm, linear in-projection, transformer blocks over the h*w tokens, out-projection."""

    def __init__(self, key: str, dim: int, depth: int, cfg: EditUNetConfig, self_attention: bool) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(cfg.norm_groups, dim, eps=1e-6)
        self.proj_in = nn.Linear(dim, dim)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(f"{key}.transformer_blocks.{i}", dim, cfg, self_attention) for i in range(depth))
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None,
                adapter: Adapter | None) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.proj_in(self.norm(x).flatten(2).transpose(1, 2))
        for block in self.transformer_blocks:
            t = block(t, ctx, mask, adapter)
        return x + self.proj_out(t).transpose(1, 2).reshape(b, c, h, w)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int, groups: int) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=1e-5)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb, cout)
        self.norm2 = nn.GroupNorm(groups, cout, eps=1e-5)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return h + (self.conv_shortcut(x) if self.conv_shortcut is not None else x)


class _Resample(nn.Module):
    def __init__(self, ch: int, down: bool) -> None:
        super().__init__()
        self.down = down
        self.conv = nn.Conv2d(ch, ch, 3, stride=2 if down else 1, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x if self.down else F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """A down block, the mid block or an up block: resnets, each followed by its transformer (if any)."""

    def __init__(self, key: str, ins: list[int], out: int, depths: tuple[int, ...], cfg: EditUNetConfig,
                 self_attention: bool, resample: str | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(c, out, cfg.time_dim, cfg.norm_groups) for c in ins)
        self.attentions = nn.ModuleList(
            SpatialTransformer(f"{key}.attentions.{i}", out, d, cfg, self_attention) for i, d in enumerate(depths)
            if d > 0)
        self.attention_of = [sum(1 for d in depths[:i] if d > 0) if depths[i] > 0 else -1 for i in range(len(depths))]
        self.downsamplers = nn.ModuleList([_Resample(out, True)]) if resample == "down" else None
        self.upsamplers = nn.ModuleList([_Resample(out, False)]) if resample == "up" else None


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding, cos first (flip_sin_to_cos), frequency shift 0."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class _TimeMLP(nn.Module):
    def __init__(self, cin: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cin, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class EditUNet(nn.Module):
    """noise prediction for [target | source] latents side by side, conditioned on VLM tokens."""

    def __init__(self, cfg: EditUNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch, n, lpb = cfg.channels, len(cfg.channels), cfg.layers_per_block
        self.conv_in = nn.Conv2d(cfg.in_channels, ch[0], 3, padding=1)
        self.time_embedding = _TimeMLP(ch[0], cfg.time_dim)
        self.add_embedding = _TimeMLP(256 * cfg.time_ids, cfg.time_dim)
        self.encoder_hid_proj = nn.Sequential(nn.Linear(cfg.context_dim, cfg.cross_dim), RMSNorm(cfg.cross_dim))
        self.down_blocks = nn.ModuleList()
        skips = [ch[0]]
        for i in range(n):
            ins = [ch[max(i - 1, 0)]] + [ch[i]] * (lpb - 1)
            self.down_blocks.append(Level(f"down_blocks.{i}", ins, ch[i], cfg.down_depths[i], cfg,
                                          cfg.self_attention[i], "down" if i < n - 1 else None))
            skips += [ch[i]] * lpb + ([ch[i]] if i < n - 1 else [])
        self.mid_block = Level("mid_block", [ch[-1], ch[-1]], ch[-1], (cfg.mid_depth, 0), cfg,
                               cfg.self_attention[-1], None)
        self.up_blocks = nn.ModuleList()
        prev = ch[-1]
        for i in range(n):
            level = n - 1 - i
            ins = []
            for _ in range(lpb + 1):
                ins.append(prev + skips.pop())
                prev = ch[level]
            self.up_blocks.append(Level(f"up_blocks.{i}", ins, ch[level], cfg.up_depths[i], cfg,
                                        cfg.self_attention[level], "up" if i < n - 1 else None))
        self.conv_norm_out = nn.GroupNorm(cfg.norm_groups, ch[0], eps=1e-5)
        self.conv_out = nn.Conv2d(ch[0], cfg.in_channels, 3, padding=1)

    def hook_points(self) -> list[str]:
        """Every projection the LLLite adapter can hook, in forward order."""
        return [k for m in self.modules() if isinstance(m, TransformerBlock) for k in m.hook_points()]

    def hook_sizes(self, latent_h: int) -> dict[str, tuple[int, int]]:
        """(input features, feature-map height of the target half) at each hook point."""
        sizes = {}
        for name, m in self.named_modules():
            if isinstance(m, TransformerBlock):
                level = _level_of(name, len(self.cfg.channels))
                for key in m.hook_points():
                    sizes[key] = (m.norm2.normalized_shape[0], latent_h // 2 ** level)
        return sizes

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None, time_ids: torch.Tensor,
                adapter: Adapter | None = None) -> torch.Tensor:
        """sample [B, 4, h, 2w]; timestep [B] in 0..1000; context [B, L, context_dim]; context_mask
        [B, L] bool (True: a real token) or None; time_ids [B, 2] -> prediction [B, 4, h, 2w]."""
        temb = self.time_embedding(_timestep_embedding(timestep, self.cfg.channels[0]).to(sample.dtype))
        ids = _timestep_embedding(time_ids.flatten(), 256).reshape(time_ids.shape[0], -1)
        temb = temb + self.add_embedding(ids.to(sample.dtype))
        ctx = self.encoder_hid_proj(context)
        mask = context_mask[:, None, None, :] if context_mask is not None else None
        x = self.conv_in(sample)
        skips = [x]
        for block in self.down_blocks:
            for j, res in enumerate(block.resnets):
                x = _attend(block, j, res(x, temb), ctx, mask, adapter)
                skips.append(x)
            if block.downsamplers is not None:
                x = block.downsamplers[0](x)
                skips.append(x)
        x = self.mid_block.resnets[0](x, temb)
        x = _attend(self.mid_block, 0, x, ctx, mask, adapter)
        x = self.mid_block.resnets[1](x, temb)
        for block in self.up_blocks:
            for j, res in enumerate(block.resnets):
                x = _attend(block, j, res(torch.cat([x, skips.pop()], dim=1), temb), ctx, mask, adapter)
            if block.upsamplers is not None:
                x = block.upsamplers[0](x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


def _attend(block: Level, j: int, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None,
            adapter: Adapter | None) -> torch.Tensor:
    i = block.attention_of[j]
    return block.attentions[i](x, ctx, mask, adapter) if i >= 0 else x


def _level_of(name: str, levels: int) -> int:
    """Resolution level of a module by its path: down i -> i, mid -> last, up i -> levels-1-i."""
    head, _, rest = name.partition(".")
    if head == "mid_block":
        return levels - 1
    idx = int(rest.split(".")[0])
    return idx if head == "down_blocks" else levels - 1 - idx
