"""Wan2.1 text-to-video diffusion transformer, built for streaming.

The architecture and parameter names are Wan2.1's own (so original checkpoints load without
renaming; diffusers and CausVid layouts are mapped in `dit_convert`): a Conv3d patch embedding,
a sinusoidal timestep embedding -> MLP -> 6-way adaLN modulation per block, a text embedding
MLP, blocks of RoPE self-attention (RMSNorm on q and k) + cross-attention to the text + GELU-tanh
FFN, and an output head with 2-way modulation. The timestep may differ per latent frame
([B, F], as in CausVid), in which case every frame gets its own modulation.

Three ways to run it, sharing one block implementation:
- `forward`: the whole sequence at once, optionally block-causal over latent frames (the oracle
  for streaming, and the training path);
- `forward_stream`: one chunk of latent frames against a `KVCache` (engine/cache/kv_cache.py);
- `embed` / `run_blocks(a, b, ...)` / `head` separately, so a pipeline rank runs blocks[a:b].
Per-prompt cross-attention K/V come from `cross_kv` and are reused until the prompt changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loom_live.engine.cache.kv_cache import (
    DEFAULT_NUM_KV_CACHE,
    DEFAULT_REFRESH_AT,
    DEFAULT_SINK,
    DEFAULT_SINK_THRESHOLD,
    CrossKV,
    KVCache,
    StreamStep,
)
from loom_live.engine.layers.attention import attention
from loom_live.engine.layers.rope import RopeTables, host_index, rotate
from loom_live.engine.models.wan_dit_ops import EAGER_OPS, BlockOps
from loom_live.host_bridge.wire.params import TRAIN_TIMESTEPS

TIME_FREQ_BASE = 10000.0  # sinusoidal timestep embedding base, as in Wan2.1
NUM_MODULATIONS = 6  # shift/scale/gate for self-attention and for the FFN
SOURCE_EDGE_VALUES = 64  # a source's edge strength per frame slot: one 8x8 pixel block (`source_edges`)
# a block's layers the cached cross-attention K/V are made with: a weight change there remakes them
CROSS_KV_LAYERS = (".cross_attn.k", ".cross_attn.v", ".cross_attn.norm_k")

SelfAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class WanDiTConfig:
    """Shape of a Wan2.1 DiT. Defaults are the 1.3B model."""

    dim: int = 1536
    ffn_dim: int = 8960
    num_heads: int = 12
    num_layers: int = 30
    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 4096
    text_len: int = 512
    freq_dim: int = 256
    eps: float = 1e-6
    cross_attn_norm: bool = True
    # What the head predicts: "flow" (Wan2.1: v = noise - x0) or "x0" (the clean latent, turned into the
    # flow it implies, so every caller still reads flow). A head narrower than a token's latent values
    # (out_channels * patch area > dim) cannot predict the noise in every direction of a flow, and the
    # noise it misses stays in x0 = x_t - sigma * v; predicting x0 leaves no noise behind.
    prediction: str = "flow"
    # Width of the latent refiner (0: none, as in Wan2.1). A head whose tokens span a 2x2 patch of many
    # latent channels gives mostly each patch's mean; the refiner is a small convolution stack on the
    # latent grid that reads the head's clean estimate beside the noisy latents and adds the per-pixel
    # detail back (x0 prediction only; it sees one latent frame at a time, so streaming stays causal).
    refiner_width: int = 0
    # Frames whose codes a latent packs side by side on the channel axis (the embedded VAE packs 4).
    # With more than 1 the refiner works per frame slot, one set of weights for every slot: each
    # frame's own noisy code in (its motion), the whole clean estimate beside it as context.
    refiner_slots: int = 1
    # The refiner also reads the head's tokens (`LatentRefiner.style`): the only place the prompt reaches
    # it. Without them it must guess the style from the coarse estimate, and the same edge is a bright
    # line in one style and a dark one in another, a switch a few small convolutions learn slowly.
    refiner_style: bool = False
    # Channels of the clean source latents given beside the noisy chunk (0: none, as in Wan2.1 T2V). A
    # model that restyles its input (the embedded default) then reads the input's own detail and motion
    # at every noise level, not only what survives the noise: the patch embedding takes them as further
    # input channels (as Wan's image-to-video model takes its condition latents) and so does the refiner.
    source_channels: int = 0
    # The source also holds the input's edge strength (engine/models/dit_source.py): each frame slot's
    # 8x8 blocks of it (SOURCE_EDGE_VALUES) beside that slot's clean codes.
    source_edges: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"dim={self.dim} is not divisible by num_heads={self.num_heads}")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"head_dim={self.head_dim} must be even and >= 6 (3-axis RoPE)")
        if self.freq_dim % 2:
            raise ValueError(f"freq_dim={self.freq_dim} must be even")
        if self.patch_size[0] != 1:
            raise ValueError(f"patch_size={self.patch_size}: streaming needs a temporal patch of 1")
        if self.prediction not in ("flow", "x0"):
            raise ValueError(f"prediction={self.prediction!r}: allowed are 'flow' and 'x0'")
        if self.refiner_width < 0 or (self.refiner_width and self.prediction != "x0"):
            raise ValueError(f"refiner_width={self.refiner_width}: must be 0, or > 0 with prediction='x0'")
        if self.refiner_style and not self.refiner_width:
            raise ValueError("refiner_style needs a refiner (refiner_width > 0)")
        if self.refiner_slots < 1 or self.out_channels % self.refiner_slots:
            raise ValueError(f"refiner_slots={self.refiner_slots}: must be >= 1 and divide "
                             f"out_channels={self.out_channels}")
        if self.source_channels < 0 or self.source_channels % self.refiner_slots:
            raise ValueError(f"source_channels={self.source_channels}: must be >= 0 and divisible by "
                             f"refiner_slots={self.refiner_slots}")
        edged = self.in_channels + self.refiner_slots * SOURCE_EDGE_VALUES
        if self.source_edges and self.source_channels != edged:
            raise ValueError(f"source_edges: source_channels must be in_channels + refiner_slots x "
                             f"{SOURCE_EDGE_VALUES} = {edged}, got {self.source_channels}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


DIT_PRESETS: dict[str, WanDiTConfig] = {
    "wan2.1-1.3b": WanDiTConfig(),
    "wan2.1-14b": WanDiTConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
    # Loom's embedded default and test model: runs on a CPU at a few FPS at 256 tokens/frame.
    "tiny": WanDiTConfig(dim=128, ffn_dim=512, num_heads=2, num_layers=4),
    # The trained embedded default (engine/models/embedded.py): conditioned on 384-d style vectors; its
    # latents are the frame VAE's (engine/models/frame_vae.py: 4 frames x 96 values per 8x8 block). It reads
    # the input's clean latents and edge strength beside the noisy ones, and refines each of a latent's 4
    # frames alone.
    "embedded": WanDiTConfig(dim=256, ffn_dim=1024, num_heads=4, num_layers=4, in_channels=384, out_channels=384,
                             text_dim=384, text_len=4, prediction="x0", refiner_width=96, refiner_slots=4,
                             refiner_style=True, source_channels=384 + 4 * SOURCE_EDGE_VALUES, source_edges=True),
}


@dataclass
class Conditioning:
    """Timestep conditioning shared by all blocks: `temb` [B, Fm, dim] feeds the head,
    `mod` [B, Fm, 6, dim] (float32) the blocks; Fm is 1 or the number of latent frames."""

    temb: torch.Tensor
    mod: torch.Tensor


class RMSNorm(nn.Module):
    """Wan's RMSNorm over the whole projection (all heads together)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class SelfAttention(nn.Module):
    """q/k/v/o projections with RMSNorm on q and k. The attention itself is supplied by the
    caller (full sequence with RoPE and mask, or the streaming KV cache)."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)
        # q, k and v as one product (`use_qkv_product`): the product and the [3 dim, dim] weight it reads
        self.qkv: tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor] | None = None

    def fuse_projections(self) -> None:
        """Keep q, k and v's weights and biases as the thirds of one [3 dim, dim] matrix (their parameters
        become views of it), so that a chunk's three projections are one matrix product: at one latent
        frame's tokens each alone is a grid that leaves much of a large GPU idle. The checkpoint names
        stay; a LoRA merge writes into the views. Anything that gives a parameter storage of its own
        (`Module.to`) ends the fusion: `project` then runs the three products again."""
        linears = (self.q, self.k, self.v)
        if not all(type(m) is nn.Linear and m.bias is not None for m in linears):
            raise ValueError("fuse_projections: q, k and v must be plain nn.Linear layers with biases "
                             "(fuse before an FP8 conversion, not after)")
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = torch.cat([m.bias.detach() for m in linears])
        for m, w, b in zip(linears, weight.chunk(3), bias.chunk(3)):
            m.weight.data, m.bias.data = w, b
        self.use_qkv_product(partial(F.linear, weight=weight, bias=bias), weight)

    def use_qkv_product(self, product: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor) -> None:
        """Project with `product` (x -> [..., 3 dim], q then k then v) while q's weight is the first third
        of `weight` (the layers are views of it: `fuse_projections`, or the FP8 conversion's one product)."""
        self.qkv = (product, weight)

    def _fused(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if self.qkv is None or self.qkv[1].data_ptr() != self.q.weight.data_ptr():
            return None
        return self.qkv[0]

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads = (self.num_heads, -1)
        fused = self._fused()
        if fused is not None:
            q, k, v = fused(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        return self.norm_q(q).unflatten(2, heads), self.norm_k(k).unflatten(2, heads), v.unflatten(2, heads)


class CrossAttention(nn.Module):
    """Attention from the video tokens to the (cached) text keys/values."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)

    def kv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads = (self.num_heads, -1)
        return self.norm_k(self.k(context)).unflatten(2, heads), self.v(context).unflatten(2, heads)

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q = self.norm_q(self.q(x)).unflatten(2, (self.num_heads, -1))
        if k.shape[0] != q.shape[0]:  # one prompt for every row
            k, v = k.expand(q.shape[0], *k.shape[1:]), v.expand(q.shape[0], *v.shape[1:])
        return self.o(attention(q, k, v).flatten(2))


class WanBlock(nn.Module):
    """One transformer block; parameter names follow Wan2.1 (norm3 is the cross-attention norm)."""

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.self_attn = SelfAttention(cfg.dim, cfg.num_heads, cfg.eps)
        self.norm3 = nn.LayerNorm(cfg.dim, eps=cfg.eps) if cfg.cross_attn_norm else None
        self.cross_attn = CrossAttention(cfg.dim, cfg.num_heads, cfg.eps)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, cfg.dim)
        )
        # In place: built on the meta device (the embedded and checkpoint loads), an out-of-place division
        # runs torch's Python reference op, whose first use imports torch._dynamo (seconds of start-up).
        self.modulation = nn.Parameter(torch.randn(1, NUM_MODULATIONS, cfg.dim).div_(cfg.dim**0.5))
        self.ops = EAGER_OPS

    def forward(
        self,
        x: torch.Tensor,
        mod: torch.Tensor,
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        self_attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        ops = self.ops
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.float()[:, None] + mod).unbind(2)

        q, k, v = self.self_attn.project(ops.norm_modulate(x, shift1, scale1, self.eps))
        x = ops.gated_residual(x, self.self_attn.o(self_attend(q, k, v).flatten(2)), gate1)

        x = x + self.cross_attn(self._cross_norm(x), cross_k, cross_v)

        y = self._ffn(ops.norm_modulate(x, shift2, scale2, self.eps))
        return ops.gated_residual(x, y, gate2)

    def _ffn(self, h: torch.Tensor) -> torch.Tensor:
        first, act, second = self.ffn
        if type(first) is not nn.Linear:  # an FP8 or other replacement of the first linear
            return second(act(first(h)))
        return second(self.ops.linear_gelu(h, first.weight, first.bias))

    def _cross_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm3 is None:  # cross_attn_norm=False: the identity, as in Wan2.1 and diffusers
            return x
        return self.ops.affine_norm(x, self.norm3.weight, self.norm3.bias, self.norm3.eps)


class LatentRefiner(nn.Module):
    """Adds per-pixel detail to a clean-latent estimate from the noisy latents beside it (see
    `WanDiTConfig.refiner_width` and `refiner_slots`). Each latent frame is refined alone; the last
    layer starts at zero, so a refiner added to a trained head starts as the identity.

    With `style_dim`, each token of the head (its normalised features, which carry the prompt through
    cross-attention) scales and shifts the first hidden layer over the latent pixels it covers (FiLM).
    That layer starts at zero (a scale of 1, no shift), so a trained refiner gains it unchanged."""

    def __init__(self, channels: int, width: int, slots: int = 1, source_channels: int = 0,
                 style_dim: int = 0) -> None:
        super().__init__()
        self.slots = slots
        per_slot = channels // slots
        context = channels if slots > 1 else 0  # the whole estimate beside each slot
        self.inp = nn.Conv2d(2 * per_slot + source_channels // slots + context + 1, width, 1)
        self.mid1 = nn.Conv2d(width, width, 3, padding=1)
        self.mid2 = nn.Conv2d(width, width, 3, padding=1)
        self.out = nn.Conv2d(width, per_slot, 1)
        self.style = nn.Linear(style_dim, 2 * width) if style_dim else None
        for layer in (self.out, self.style):
            if layer is not None:
                nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)

    def forward(self, x0: torch.Tensor, x_t: torch.Tensor, sigma: torch.Tensor,
                source: torch.Tensor | None = None, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x0, x_t [B, C, F, H, W]; sigma broadcastable to [B, 1, F, 1, 1]; source [B, S, F, H, W] for a
        refiner built with source channels (its slots beside the estimate's); tokens [B, F, h, w, dim]
        (each covering an (H/h) x (W/w) patch) for one built with `style_dim`."""
        b, c, f, h, w = x0.shape
        s = sigma.to(x0.dtype).expand(b, 1, f, h, w)
        own = [x_t.to(x0.dtype)] + ([] if source is None else [source.to(x0.dtype)])
        if self.slots == 1:
            x = torch.cat([x0, *own, s], dim=1).transpose(1, 2).flatten(0, 1)  # [B*F, cin, H, W]
        else:
            k = self.slots
            parts = [x0.unflatten(1, (k, c // k)), *(t.unflatten(1, (k, t.shape[1] // k)) for t in own),
                     x0[:, None].expand(b, k, c, f, h, w), s[:, None].expand(b, k, 1, f, h, w)]
            x = torch.cat(parts, dim=2).permute(0, 3, 1, 2, 4, 5).flatten(0, 2)  # [B*F*k, cin, H, W]
        hidden = F.silu(self.inp(x))
        if self.style is not None:
            hidden = self._modulate(hidden, tokens, h, w)
        y = self.out(F.silu(self.mid2(F.silu(self.mid1(hidden)))))
        if self.slots == 1:
            return x0 + y.unflatten(0, (b, f)).transpose(1, 2)
        return x0 + y.unflatten(0, (b, f, self.slots)).permute(0, 2, 3, 1, 4, 5).flatten(1, 2)

    def _modulate(self, hidden: torch.Tensor, tokens: torch.Tensor | None, h: int, w: int) -> torch.Tensor:
        """hidden [B*F*slots, width, H, W] scaled and shifted by the style of the token over each pixel."""
        if tokens is None:
            raise ValueError("this refiner reads the head's tokens (refiner_style): tokens=[B, F, h, w, dim]")
        gb = self.style(tokens.to(hidden.dtype)).permute(0, 1, 4, 2, 3).flatten(0, 1)  # [B*F, 2*width, h, w]
        gb = gb.repeat_interleave(h // gb.shape[2], dim=2).repeat_interleave(w // gb.shape[3], dim=3)
        gamma, beta = gb.repeat_interleave(self.slots, dim=0).chunk(2, dim=1)
        return hidden * (1.0 + gamma) + beta


class Head(nn.Module):
    """Output norm with 2-way modulation, projection to patches, unpatchify, and (x0 models) the
    optional latent refiner."""

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        self.eps = cfg.eps
        self.patch_size = cfg.patch_size
        self.out_channels = cfg.out_channels
        self.prediction = cfg.prediction
        self.head = nn.Linear(cfg.dim, cfg.out_channels * math.prod(cfg.patch_size))
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim).div_(cfg.dim**0.5))  # in place: see WanBlock
        self.refiner = (LatentRefiner(cfg.out_channels, cfg.refiner_width, cfg.refiner_slots, cfg.source_channels,
                                      cfg.dim if cfg.refiner_style else 0) if cfg.refiner_width else None)
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor, cond: Conditioning, grid: tuple[int, int, int],
                x_t: torch.Tensor | None = None, sigma: torch.Tensor | None = None,
                source: torch.Tensor | None = None) -> torch.Tensor:
        """The flow for the chunk's latents `x_t` at noise `sigma` ([B] or [B, F]; both are needed
        only when the model predicts x0) and, for a model with source channels, their clean `source`."""
        shift, scale = (self.modulation.float()[:, None] + cond.temb.float()[:, :, None]).unbind(2)
        tokens = self.ops.norm_modulate(x, shift, scale, self.eps)
        x = self.head(tokens)
        (f, h, w), (pt, ph, pw) = grid, self.patch_size
        x = x.reshape(x.shape[0], f, h, w, pt, ph, pw, self.out_channels)
        out = x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(
            x.shape[0], self.out_channels, f * pt, h * ph, w * pw
        )
        if self.prediction == "flow":
            return out
        if x_t is None or sigma is None:
            raise ValueError("a model that predicts x0 needs the chunk's latents and sigma to give its flow")
        s = sigma.float().view(sigma.shape[0], 1, -1, 1, 1).clamp_min(1e-4)
        if self.refiner is not None:
            out = self.refiner(out, x_t, s, source, tokens.unflatten(1, (f, h, w)))
        return ((x_t.float() - out.float()) / s).to(out.dtype)


class FullSequenceAttention:
    """Self-attention over the whole clip: RoPE at positions 0..F-1 and an optional
    block-causal mask: frames attend to their own block and to earlier blocks. Blocks are
    `k` frames each for an int k, or the given lengths (e.g. [2, 1, 1] like a stream's chunks)."""

    def __init__(
        self, rope: RopeTables, grid: tuple[int, int, int], block_causal_frames: int | Sequence[int] | None
    ) -> None:
        f, h, w = grid
        self.cos, self.sin = rope.grid(torch.arange(f), h, w)
        self.mask = None
        if block_causal_frames is not None:
            lengths = block_causal_frames
            if isinstance(lengths, int):
                lengths = [lengths] * -(-f // lengths) if lengths > 0 else [lengths]
            lengths = list(lengths)
            if min(lengths) < 1 or sum(lengths) < f:
                raise ValueError(
                    f"block_causal_frames={block_causal_frames} must be >= 1 and cover {f} frames"
                )
            block = [i for i, n in enumerate(lengths) for _ in range(n)][:f]
            ids = host_index(block, rope.device).repeat_interleave(h * w)
            self.mask = ids[:, None] >= ids[None, :]

    def __call__(self, block: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention(rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin), v, self.mask)


class WanDiT(nn.Module):
    """The Wan2.1 DiT. Holds parameters only; stream state lives in `KVCache` / `CrossKV`."""

    def __init__(self, cfg: WanDiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.patch_embedding = nn.Conv3d(
            cfg.in_channels + cfg.source_channels, d, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, d), nn.GELU(approximate="tanh"), nn.Linear(d, d)
        )
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, d * NUM_MODULATIONS))
        self.blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        self._rope: RopeTables | None = None
        self.ops = EAGER_OPS

    # ----- loading ----------------------------------------------------------------------
    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        cfg: WanDiTConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        blocks: range | None = None,
    ) -> WanDiT:
        """Build on the meta device and load a checkpoint (Wan2.1, diffusers or CausVid /
        StreamDiffusionV2 layout) straight into `device`/`dtype`, strictly. With `blocks`, only
        those transformer blocks are loaded (the rest stay on the meta device: a pipeline rank);
        embeddings and head are always loaded, they are small."""
        from loom_live.engine.models.dit_convert import load_dit_weights

        with torch.device("meta"):
            model = cls(cfg)
        load_dit_weights(model, path, device=device, dtype=dtype, blocks=blocks)
        return model

    def fuse_elementwise(self, ops: BlockOps | None = None) -> None:
        """Run the blocks' norm/modulation/gate/RoPE chains through `ops` (default: compiled).

        With CUDA graphs those memory-bound chains are a large share of the streaming forward's
        GPU time; compiled, each becomes one or two kernels. Needs a torch.compile backend
        (Triton on CUDA); `BlockOps.eager()` switches back.
        """
        ops = BlockOps.compiled() if ops is None else ops
        if any(getattr(m, "ops", ops).quantized_norms for m in self.modules()):
            raise ValueError("fuse_elementwise: the blocks' norms quantise for their FP8 layers; choose the ops "
                             "before convert_dit_to_fp8, which builds on them")
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    def fuse_projections(self) -> None:
        """Every loaded block's q/k/v projections as one matrix product (`SelfAttention.fuse_projections`);
        blocks left on the meta device (another pipeline rank's) are skipped. Call after the weights are
        loaded and cast, and before a LoRA merger or an FP8 conversion takes the layers."""
        for module in self.modules():
            if isinstance(module, SelfAttention) and not module.norm_q.weight.is_meta:
                module.fuse_projections()

    # ----- pieces -----------------------------------------------------------------------
    def rope(self, device: torch.device) -> RopeTables:
        """RoPE tables on `device`, built once (not module state: they are constants)."""
        if self._rope is None or self._rope.device != device:
            self._rope = RopeTables(self.cfg.head_dim, device)
        return self._rope

    def condition(self, timestep: torch.Tensor, frames: int) -> Conditioning:
        """Timestep conditioning; `timestep` is [B] or [B, frames], values in 0..1000."""
        if timestep.ndim not in (1, 2) or (timestep.ndim == 2 and timestep.shape[1] not in (1, frames)):
            raise ValueError(f"timestep must be [B] or [B, {frames}], got {tuple(timestep.shape)}")
        t = timestep.float().reshape(timestep.shape[0], -1)
        half = self.cfg.freq_dim // 2
        freqs = torch.exp(
            -math.log(TIME_FREQ_BASE) * torch.arange(half, device=t.device, dtype=torch.float32) / half
        )
        angles = t[..., None] * freqs
        sinusoid = torch.cat((angles.cos(), angles.sin()), dim=-1)
        param = self.time_embedding[0].weight
        temb = self.time_embedding(sinusoid.to(param.dtype))
        mod = self.time_projection(temb).float().unflatten(-1, (NUM_MODULATIONS, -1))
        return Conditioning(temb=temb, mod=mod)

    def token_grid(self, x: torch.Tensor, channels: int, what: str) -> tuple[int, int, int]:
        """The token grid (F, h, w) of latents x [B, channels, F, H, W]; ValueError naming `what` when
        the shape does not fit the model."""
        if x.ndim != 5 or x.shape[1] != channels:
            raise ValueError(f"{what} must be [B, {channels}, F, H, W], got {tuple(x.shape)}")
        _, ph, pw = self.cfg.patch_size
        if x.shape[3] % ph or x.shape[4] % pw:
            raise ValueError(f"{what}: size {tuple(x.shape[3:])} is not divisible by the patch {self.cfg.patch_size}")
        return x.shape[2], x.shape[3] // ph, x.shape[4] // pw

    def embed(
        self, x: torch.Tensor, timestep: torch.Tensor, source: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Conditioning, tuple[int, int, int]]:
        """Patchify latents [B, C, F, H, W] (beside their clean `source` latents, for a model with
        source channels) into tokens [B, F*h*w, dim]; returns (tokens, conditioning, token grid (F, h, w))."""
        self.token_grid(x, self.cfg.in_channels, "latents")
        if timestep.shape[0] != x.shape[0]:
            raise ValueError(f"timestep has {timestep.shape[0]} rows for a batch of {x.shape[0]}")
        param = self.patch_embedding.weight
        if self.cfg.source_channels:
            x = torch.cat([x.to(param.dtype), self.check_source(x, source).to(param.dtype)], dim=1)
        tokens = self.patch_embedding(x.to(param.dtype))
        grid = tuple(tokens.shape[2:])
        return tokens.flatten(2).transpose(1, 2).contiguous(), self.condition(timestep, grid[0]), grid

    def check_source(self, x: torch.Tensor, source: torch.Tensor | None) -> torch.Tensor:
        """The clean source latents of chunk `x`, which a model with source channels needs."""
        cfg = self.cfg
        if source is None:
            raise ValueError(f"this model restyles its input: it needs the chunk's clean source latents "
                             f"[B, {cfg.source_channels}, F, H, W] beside the noisy ones (source=...)")
        if source.ndim != 5 or source.shape[1] != cfg.source_channels or source.shape[0] != x.shape[0] \
                or source.shape[2:] != x.shape[2:]:
            raise ValueError(f"source latents must be [{x.shape[0]}, {cfg.source_channels}, "
                             f"{', '.join(map(str, x.shape[2:]))}] for this chunk, got {tuple(source.shape)}")
        return source

    def cross_kv(self, context: torch.Tensor, blocks: Sequence[int] | None = None) -> CrossKV:
        """Cross-attention K/V of a prompt embedding [B or 1, L <= text_len, text_dim] (zero-padded
        to text_len as Wan2.1 does) for the given blocks (default all)."""
        cfg = self.cfg
        if context.ndim != 3 or context.shape[2] != cfg.text_dim or context.shape[1] > cfg.text_len:
            raise ValueError(
                f"context must be [B, L<={cfg.text_len}, {cfg.text_dim}], got {tuple(context.shape)}"
            )
        param = self.text_embedding[0].weight
        if context.shape[1] < cfg.text_len:
            context = F.pad(context, (0, 0, 0, cfg.text_len - context.shape[1]))
        emb = self.text_embedding(context.to(param.dtype))
        ids = range(cfg.num_layers) if blocks is None else blocks
        k, v = {}, {}
        for i in ids:
            k[i], v[i] = self.blocks[i].cross_attn.kv(emb)
        return CrossKV(k, v)

    def cross_kv_blocks(self, changed: Collection[str]) -> list[int] | None:
        """The blocks whose cross-attention K/V a change of these layers' weights (module names, as
        LoRAs name them) alters: those whose cross-attention k, v or norm_k changed; None for every block
        (the text embedding, which all of them read, changed)."""
        if any(name.startswith("text_embedding.") for name in changed):
            return None
        return sorted({int(name.split(".")[1]) for name in changed
                       if name.startswith("blocks.") and name.endswith(CROSS_KV_LAYERS)})

    def cross_kv_refreshed(self, cross: CrossKV, context: torch.Tensor, rewritten: Collection[str],
                           blocks: Sequence[int] | None = None) -> CrossKV:
        """`cross` (K/V of `context`) after the `rewritten` layers' weights changed: the K/V of the blocks
        that change reaches (`cross_kv_blocks`; of `blocks` alone where given) made again, the others kept as
        they are; `cross` itself where it reaches none."""
        reached = self.cross_kv_blocks(rewritten)
        if reached is None:
            reached = blocks
        elif blocks is not None:
            reached = [b for b in reached if b in blocks]
        if reached is not None and not reached:
            return cross
        return cross.updated(self.cross_kv(context, reached))

    def run_blocks(
        self,
        start: int,
        stop: int,
        x: torch.Tensor,
        cond: Conditioning,
        cross: CrossKV,
        self_attend: SelfAttend,
        hints: Mapping[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run blocks[start:stop] on tokens x [B, L, dim]. `self_attend(block, q, k, v)` is the
        self-attention: `FullSequenceAttention` or `KVCache.attention(step)`. `hints[i]`, where
        given, is added to the tokens after block i (VACE's control hints, already scaled)."""
        for i in range(start, stop):
            block = self.blocks[i]
            if block.modulation.is_meta:
                raise RuntimeError(f"block {i} was not loaded on this rank (from_checkpoint(blocks=...))")
            x = block(x, cond.mod, cross.k[i], cross.v[i], lambda q, k, v, i=i: self_attend(i, q, k, v))
            if hints is not None and i in hints:
                x = x + hints[i].to(x.dtype)
        return x

    # ----- whole passes -----------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        context: torch.Tensor,
        block_causal_frames: int | Sequence[int] | None = None,
        source: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Flow prediction for a whole clip x [B, 16, F, H, W] (with its clean `source` latents, for a
        model with source channels); `block_causal_frames=k` makes attention block-causal over latent
        frames in blocks of k frames."""
        tokens, cond, grid = self.embed(x, timestep, source)
        attend = FullSequenceAttention(self.rope(tokens.device), grid, block_causal_frames)
        tokens = self.run_blocks(0, self.cfg.num_layers, tokens, cond, self.cross_kv(context), attend)
        return self.head(tokens, cond, grid, x, timestep / TRAIN_TIMESTEPS, source)

    def new_cache(
        self,
        batch: int,
        frame_shape: tuple[int, int],
        num_kv_cache: int = DEFAULT_NUM_KV_CACHE,
        sink: int = DEFAULT_SINK,
        rope_policy: str = "refresh",
        refresh_at: int = DEFAULT_REFRESH_AT,
        sink_threshold: float = DEFAULT_SINK_THRESHOLD,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        blocks: Sequence[int] | None = None,
    ) -> KVCache:
        """A KV cache for `batch` streams of latent frames of `frame_shape` (H, W)."""
        _, ph, pw = self.cfg.patch_size
        if frame_shape[0] % ph or frame_shape[1] % pw:
            raise ValueError(
                f"latent frame {frame_shape} is not divisible by the patch {self.cfg.patch_size}"
            )
        param = self.patch_embedding.weight
        return KVCache.allocate(
            batch,
            (frame_shape[0] // ph, frame_shape[1] // pw),
            self.cfg.num_heads,
            self.cfg.head_dim,
            range(self.cfg.num_layers) if blocks is None else blocks,
            num_kv_cache=num_kv_cache,
            sink=sink,
            rope_policy=rope_policy,
            refresh_at=refresh_at,
            sink_threshold=sink_threshold,
            device=param.device if device is None else device,
            dtype=param.dtype if dtype is None else dtype,
        )

    def forward_stream(
        self,
        x: torch.Tensor,
        timestep: torch.Tensor,
        cache: KVCache,
        cross: CrossKV,
        commit: bool | Sequence[bool] = True,
        **inputs: torch.Tensor | float,
    ) -> torch.Tensor:
        """Flow prediction for one chunk x [B, 16, f, H, W] of B independent streams: each row
        attends to its cached window and itself; with `commit` the chunk's K/V enter the cache.
        `inputs` go to `stream_step` (a subclass's further per-chunk inputs)."""
        if x.ndim != 5 or x.shape[0] != cache.batch:
            raise ValueError(
                f"chunk must be [{cache.batch}, C, f, H, W] for this cache, got {tuple(x.shape)}"
            )
        grid = self.token_grid(x, self.cfg.in_channels, "latents")
        if grid[1:] != cache.token_grid:
            raise ValueError(f"chunk token grid {grid[1:]} differs from the cache's {cache.token_grid}")
        step = cache.plan(grid[0], commit)
        out = self.stream_step(x, timestep, cache, cross, step, **inputs)
        cache.finish(step)
        return out

    def stream_step(self, x: torch.Tensor, timestep: torch.Tensor, cache: KVCache, cross: CrossKV,
                    step: StreamStep, source: torch.Tensor | None = None) -> torch.Tensor:
        """The device work of one chunk already planned on the host: what a CUDA graph captures."""
        tokens, cond, grid = self.embed(x, timestep, source)
        attend = cache.attention(step, self.ops.cache)
        tokens = self.run_blocks(0, self.cfg.num_layers, tokens, cond, cross, attend)
        return self.head(tokens, cond, grid, x, timestep / TRAIN_TIMESTEPS, source)


def preset(name: str, **overrides: object) -> WanDiTConfig:
    """A preset config by name, optionally with fields replaced."""
    if name not in DIT_PRESETS:
        raise ValueError(f"unknown DiT preset {name!r}; allowed: {', '.join(DIT_PRESETS)}")
    return replace(DIT_PRESETS[name], **overrides)
