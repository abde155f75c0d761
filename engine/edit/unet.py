"""The edit denoiser: DreamLite's UNet (diffusers' `DreamLiteUNetModel`), built from its config.

Editing works by in-context spatial concatenation: the noisy target latent and the source
latent sit side by side along the width, [B, 4, h, 2w] (text-to-image puts zeros on the right),
and every layer sees both; the output's left half is the prediction for the target.
Conditioning is the vision-language model's last hidden state, projected once (Linear + RMSNorm)
to the cross-attention width; the target size (width, height) is embedded like the timestep.

What DreamLite adds to the SDXL-style UNet, all reproduced here: depthwise-separable resnet
convolutions that expand to twice the channels in between; grouped-query attention with one
key/value head and RMSNorm on each head of q and k; blocks without self-attention at the high
resolutions, where the block's first LayerNorm output *replaces* the hidden state (no residual:
DreamLite's released weights were trained that way); a GEGLU feed-forward of width 3x.

Speed: with one KV head every query head attends to the same keys, so the heads are folded into
the query sequence and attention runs as one head over H*N queries: the same result as repeating
K/V H times (what diffusers does), without materialising the repeats. The forward has no
data-dependent branches, so it compiles to one graph with the LLLite adapter, which is asked
(state kept outside the model) for the shifted input of each hooked projection.

Module and parameter names are diffusers' (`down_blocks.0.resnets.0.conv1.depthwise.weight`,
`...transformer_blocks.0.attn2.to_q.weight`), so a released checkpoint loads with no renaming and
each LLLite hook is named by its projection's path.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from loom_live.engine.edit.unet_config import UNET_PRESETS, EditUNetConfig

__all__ = ["Adapter", "EditUNet", "EditUNetConfig", "HOOK_PROJECTIONS", "UNET_PRESETS"]

HOOK_PROJECTIONS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn2.to_q")
TRANSFORMER_NORM_EPS = 1e-5  # DreamLite's transformer LayerNorms (not the UNet's norm_eps)
TRANSFORMER_GROUPNORM_EPS = 1e-6
QK_NORM_EPS = 1e-5


class Adapter(Protocol):
    """Shifts the input of a hooked attention projection (the LLLite adapter)."""

    def shift(self, key: str, x: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """Normalised in float32, scaled in the weight's dtype (as diffusers' RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(self.weight.dtype) * self.weight


class Attention(nn.Module):
    """`heads` query heads over `kv_heads` key/value heads (GQA), optional RMSNorm on q and k."""

    def __init__(self, dim: int, kv_in: int, heads: int, kv_heads: int | None, qk_norm: bool) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.kv_heads = kv_heads or heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(kv_in, self.kv_heads * self.head_dim, bias=False)
        self.to_v = nn.Linear(kv_in, self.kv_heads * self.head_dim, bias=False)
        self.norm_q = RMSNorm(self.head_dim, QK_NORM_EPS) if qk_norm else nn.Identity()
        self.norm_k = RMSNorm(self.head_dim, QK_NORM_EPS) if qk_norm else nn.Identity()
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
    """GEGLU (diffusers names: net.0.proj, net.2)."""

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
    """LayerNorm, self-attention (or its DreamLite replacement), cross-attention, GEGLU."""

    def __init__(self, key: str, dim: int, heads: int, cfg: EditUNetConfig, self_attention: bool) -> None:
        super().__init__()
        self.keys = {p: f"{key}.{p}" for p in HOOK_PROJECTIONS}
        self.norm1 = nn.LayerNorm(dim, eps=TRANSFORMER_NORM_EPS)
        self.attn1 = Attention(dim, dim, heads, cfg.kv_heads, cfg.qk_norm) if self_attention else None
        self.norm2 = nn.LayerNorm(dim, eps=TRANSFORMER_NORM_EPS)
        self.attn2 = Attention(dim, cfg.cross_dim, heads, cfg.kv_heads, cfg.qk_norm)
        self.norm3 = nn.LayerNorm(dim, eps=TRANSFORMER_NORM_EPS)
        self.ff = FeedForward(dim, cfg.ff_mult)

    def hook_points(self) -> list[str]:
        return [k for p, k in self.keys.items() if self.attn1 is not None or not p.startswith("attn1")]

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None,
                adapter: Adapter | None) -> torch.Tensor:
        h = self.norm1(x)
        if self.attn1 is None:
            x = h  # DreamLite's "removed self-attention": the normalised state goes on, without a residual
        else:
            q = k = v = h
            if adapter is not None:
                q, k, v = (adapter.shift(self.keys[p], h) for p in HOOK_PROJECTIONS[:3])
            x = x + self.attn1(q, k, v)
        h = self.norm2(x)
        q = adapter.shift(self.keys["attn2.to_q"], h) if adapter is not None else h
        x = x + self.attn2(q, ctx, ctx, mask)
        return x + self.ff(self.norm3(x))


class SpatialTransformer(nn.Module):
    """GroupNorm, in-projection, transformer blocks over the h*w tokens, out-projection, residual."""

    def __init__(self, key: str, dim: int, heads: int, depth: int, cfg: EditUNetConfig,
                 self_attention: bool) -> None:
        super().__init__()
        self.linear = cfg.linear_projection
        self.norm = nn.GroupNorm(cfg.norm_groups, dim, eps=TRANSFORMER_GROUPNORM_EPS)
        self.proj_in = nn.Linear(dim, dim) if self.linear else nn.Conv2d(dim, dim, 1)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(f"{key}.transformer_blocks.{i}", dim, heads, cfg, self_attention) for i in range(depth))
        self.proj_out = nn.Linear(dim, dim) if self.linear else nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None,
                adapter: Adapter | None) -> torch.Tensor:
        b, c, h, w = x.shape
        t = self.norm(x)
        if not self.linear:
            t = self.proj_in(t)
        t = t.permute(0, 2, 3, 1).reshape(b, h * w, c)
        if self.linear:
            t = self.proj_in(t)
        for block in self.transformer_blocks:
            t = block(t, ctx, mask, adapter)
        if self.linear:
            t = self.proj_out(t)
        t = t.reshape(b, h, w, c).permute(0, 3, 1, 2)
        return (t if self.linear else self.proj_out(t)) + x


class SeparableConv(nn.Module):
    """3x3 depthwise then 1x1 pointwise, no biases."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(cin, cin, 3, padding=1, groups=cin, bias=False)
        self.pointwise = nn.Conv2d(cin, cout, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(x))


class ResnetBlock(nn.Module):
    """GroupNorm-SiLU-conv twice with the time embedding added between; separable convolutions
    widen to 2 x cout inside the block."""

    def __init__(self, cin: int, cout: int, cfg: EditUNetConfig, scale: float = 1.0) -> None:
        super().__init__()
        inner = 2 * cout if cfg.sep_conv else cout
        self.scale = scale
        self.norm1 = nn.GroupNorm(cfg.norm_groups, cin, eps=cfg.norm_eps)
        self.conv1 = SeparableConv(cin, inner) if cfg.sep_conv else nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(cfg.temb_dim, inner)
        self.norm2 = nn.GroupNorm(cfg.norm_groups, inner, eps=cfg.norm_eps)
        self.conv2 = SeparableConv(inner, cout) if cfg.sep_conv else nn.Conv2d(cout, cout, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        out = (self.conv_shortcut(x) if self.conv_shortcut is not None else x) + h
        return out if self.scale == 1.0 else out / self.scale


class _Resample(nn.Module):
    def __init__(self, ch: int, down: bool) -> None:
        super().__init__()
        self.down = down
        self.conv = nn.Conv2d(ch, ch, 3, stride=2 if down else 1, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x if self.down else F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """A down, mid or up block: resnets, each followed by its attention where the block has them."""

    def __init__(self, key: str, ins: list[int], out: int, heads: int, depths: tuple[int, ...] | None,
                 cfg: EditUNetConfig, self_attention: bool, resample: str | None, scale: float = 1.0) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(c, out, cfg, scale) for c in ins)
        self.attentions = nn.ModuleList(
            SpatialTransformer(f"{key}.attentions.{i}", out, heads, d, cfg, self_attention)
            for i, d in enumerate(depths or ()))
        self.downsamplers = nn.ModuleList([_Resample(out, True)]) if resample == "down" else None
        self.upsamplers = nn.ModuleList([_Resample(out, False)]) if resample == "up" else None

    def run(self, j: int, x: torch.Tensor, temb: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None,
            adapter: Adapter | None) -> torch.Tensor:
        """Resnet j, then attention j if the block has attentions."""
        x = self.resnets[j](x, temb)
        return self.attentions[j](x, ctx, mask, adapter) if len(self.attentions) else x


def timestep_embedding(t: torch.Tensor, dim: int, flip_sin_to_cos: bool, freq_shift: float) -> torch.Tensor:
    """Sinusoidal embedding in float32 (diffusers' get_timestep_embedding, max period 10000)."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / (half - freq_shift)
    args = t.float()[:, None] * torch.exp(exponent)[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)] if flip_sin_to_cos else [torch.sin(args), torch.cos(args)], -1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


class _TimeMLP(nn.Module):
    def __init__(self, cin: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cin, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class EditUNet(nn.Module):
    """Velocity prediction for [target | source] latents side by side, conditioned on VLM tokens."""

    def __init__(self, cfg: EditUNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch, n, lpb = cfg.channels, len(cfg.channels), cfg.layers_per_block
        self.conv_in = nn.Conv2d(4, ch[0], 3, padding=1)
        self.time_embedding = _TimeMLP(ch[0], cfg.temb_dim)
        self.add_embedding = _TimeMLP(cfg.time_ids_proj, cfg.temb_dim) if cfg.time_ids_dim else None
        self.encoder_hid_proj = (nn.Sequential(nn.Linear(cfg.context_dim, cfg.cross_dim), RMSNorm(cfg.cross_dim, 1e-5))
                                 if cfg.context_dim else None)
        self.down_blocks = nn.ModuleList(
            Level(f"down_blocks.{i}", [ch[max(i - 1, 0)]] + [ch[i]] * (lpb[i] - 1), ch[i], cfg.heads[i],
                  None if cfg.down[i] == "plain" else (cfg.depth[i],) * lpb[i], cfg, cfg.down[i] == "cross",
                  "down" if i < n - 1 else None)
            for i in range(n))
        self.mid_block = Level("mid_block", [ch[-1]] * (cfg.mid_layers + 1), ch[-1], cfg.heads[-1],
                               (cfg.depth[-1],) * cfg.mid_layers, cfg, True, None, cfg.mid_scale)
        self.up_blocks = nn.ModuleList(self._up_block(i) for i in range(n))
        self.conv_norm_out = nn.GroupNorm(cfg.norm_groups, ch[0], eps=cfg.norm_eps)
        self.conv_out = nn.Conv2d(ch[0], 4, 3, padding=1)

    def _up_block(self, i: int) -> Level:
        """Up block i at level n-1-i, with diffusers' channel plumbing (the last resnet takes the skip
        from the level below)."""
        cfg, n = self.cfg, len(self.cfg.channels)
        level = n - 1 - i
        out, below = cfg.channels[level], cfg.channels[max(level - 1, 0)]
        prev = cfg.channels[min(level + 1, n - 1)]
        layers = cfg.layers_per_block[level] + 1
        ins = [(prev if j == 0 else out) + (below if j == layers - 1 else out) for j in range(layers)]
        kind = cfg.up[i]
        return Level(f"up_blocks.{i}", ins, out, cfg.heads[level], None if kind == "plain" else cfg.up_depths(i),
                     cfg, kind == "cross", "up" if i < n - 1 else None)

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
                context_mask: torch.Tensor | None, time_ids: torch.Tensor | None,
                adapter: Adapter | None = None) -> torch.Tensor:
        """sample [B, 4, h, 2w]; timestep [B] in 0..1000; context [B, L, context_dim]; context_mask
        [B, L] bool (True: a real token) or None; time_ids [B, 2] (width, height) -> velocity [B, 4, h, 2w]."""
        cfg = self.cfg
        temb = self.time_embedding(
            timestep_embedding(timestep, cfg.channels[0], cfg.flip_sin_to_cos, cfg.freq_shift).to(sample.dtype))
        if self.add_embedding is not None:
            ids = timestep_embedding(time_ids.flatten(), cfg.time_ids_dim, cfg.flip_sin_to_cos, cfg.freq_shift)
            temb = temb + self.add_embedding(ids.reshape(sample.shape[0], -1).to(temb.dtype))
        ctx = self.encoder_hid_proj(context) if self.encoder_hid_proj is not None else context
        mask = context_mask[:, None, None, :] if context_mask is not None else None
        x = self.conv_in(sample)
        skips = [x]
        for block in self.down_blocks:
            for j in range(len(block.resnets)):
                x = block.run(j, x, temb, ctx, mask, adapter)
                skips.append(x)
            if block.downsamplers is not None:
                x = block.downsamplers[0](x)
                skips.append(x)
        mid = self.mid_block
        x = mid.resnets[0](x, temb)
        for attention, resnet in zip(mid.attentions, mid.resnets[1:]):
            x = resnet(attention(x, ctx, mask, adapter), temb)
        for block in self.up_blocks:
            for j in range(len(block.resnets)):
                x = block.run(j, torch.cat([x, skips.pop()], dim=1), temb, ctx, mask, adapter)
            if block.upsamplers is not None:
                x = block.upsamplers[0](x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


def _level_of(name: str, levels: int) -> int:
    """Resolution level of a module by its path: down i -> i, mid -> last, up i -> levels-1-i."""
    head, _, rest = name.partition(".")
    if head == "mid_block":
        return levels - 1
    idx = int(rest.split(".")[0])
    return idx if head == "down_blocks" else levels - 1 - idx
