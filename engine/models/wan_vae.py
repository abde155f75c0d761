"""The Wan2.1 video VAE (causal 3D conv autoencoder, 4x8x8 compression) with streaming encode/decode.

Architecture facts (the same function as Wan2.1's `wan/modules/vae.py` and diffusers'
`AutoencoderKLWan`): causal 3D convs, RMS norms over channels, residual blocks, one
single-head spatial attention per mid block, spatial down/up-sampling by 2 per level and
temporal down/up-sampling by 2 on the levels flagged in `temporal_downsample`, where the very
first frame of a video passes through the temporal resampling alone (1 + 4k frames <-> 1 + k
latents).

Why streaming is exact here: every layer is either per-frame (norms, attention, 2D resampling)
or causal in time, and a causal layer only needs a bounded number of past frames, held in a
`FrameCache`. The first chunk starts from zero history, which is the causal zero padding of a
one-shot pass. So a stream of chunks computes exactly the one-shot function, and one-shot
encode/decode are themselves run as a stream (bounded memory on long clips).

Parameter names follow diffusers' `AutoencoderKLWan`; `vae_convert` maps the original
`Wan2.1_VAE.pth` names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loom_live.engine.cache.vae_cache import FrameCache, VAEStreamState, check_signature
from loom_live.engine.graphs.saved_compiles import SavedCompile
from loom_live.engine.layers.attention import matmul_attention
from loom_live.engine.layers.phase_upsample import UPSAMPLE_KINDS, PhaseUpsampleConv
from loom_live.engine.layers.thin_conv import THIN_CHANNELS, THIN_KINDS, ThinConv3d, thin_kind
from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files, load_into_module

# Per-channel statistics of Wan2.1 latents (Wan2.1 `WanVAE`, diffusers `latents_mean/std`).
WAN21_LATENTS_MEAN = (
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
    0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
)
WAN21_LATENTS_STD = (
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160,
)
TIME_STRIDE = 4  # pixel frames per latent frame (after the first)
SPACE_STRIDE = 8  # pixels per latent cell along H and W
PIXEL_CHANNELS = 3
NORM_EPS = 1e-12  # F.normalize's floor on the channel norm
ATTENTION_FORMS = ("kernel", "matmul")  # AttentionBlock.form
ONE_SHOT_CHUNK_LATENTS = 4  # one-shot encode/decode run as a stream of this many latents per step


@dataclass(frozen=True)
class WanVAEConfig:
    """Architecture and latent conventions. `normalize_on_encode` returns (z - mean) / std;
    `denormalize_on_decode` maps z * std + mean before decoding (StreamDiffusionV2's generator
    takes raw encoder output and emits normalised latents: encode raw, denormalise on decode)."""

    base_dim: int = 96
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temporal_downsample: tuple[bool, ...] = (False, True, True)
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    normalize_on_encode: bool = False
    denormalize_on_decode: bool = False

    def __post_init__(self) -> None:
        if len(self.temporal_downsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"WanVAEConfig.temporal_downsample has {len(self.temporal_downsample)} entries; "
                f"it needs len(dim_mult) - 1 = {len(self.dim_mult) - 1}"
            )
        if sum(self.temporal_downsample) != 2 or len(self.dim_mult) != 4:
            raise ValueError(
                "WanVAEConfig: the stream contract (1 + 4k frames, 8x spatial) needs 4 levels "
                f"with exactly 2 temporal downsamples; got dim_mult={self.dim_mult}, "
                f"temporal_downsample={self.temporal_downsample}"
            )
        for name in ("latents_mean", "latents_std"):
            if len(getattr(self, name)) != self.z_dim:
                raise ValueError(f"WanVAEConfig.{name} needs z_dim = {self.z_dim} values")


VAE_PRESETS: dict[str, WanVAEConfig] = {
    "wan2.1": WanVAEConfig(),
    # Same architecture at 1/12 width with one residual block per level: the embedded default
    # and the CPU test model (small enough for the CPU test suite).
    "tiny": WanVAEConfig(base_dim=8, num_res_blocks=1),
}


class CausalConv3d(nn.Conv3d):
    """3D conv that sees the current frame and the ones before it, never the future.

    Space is zero-padded by the conv itself; time is padded by this layer's history in the
    stream cache (zeros at the start of a stream, then the previous chunk's last frames).
    """

    def __init__(self, cin: int, cout: int, kernel: int | tuple, stride: int | tuple = 1,
                 padding: int | tuple = 0) -> None:
        kernel, stride, padding = (_triple(v) for v in (kernel, stride, padding))
        super().__init__(cin, cout, kernel, stride=stride, padding=(0, padding[1], padding[2]))
        self.history = 2 * padding[0]
        self.cache_key = ""
        self.thin: ThinConv3d | None = None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        if self.history:
            return cache.through(self.cache_key, x, self.history, self._conv)
        return self._conv(x)

    def _conv(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.thin is None else self.thin(x)


def _triple(v: int | tuple) -> tuple[int, int, int]:
    return (v, v, v) if isinstance(v, int) else tuple(v)


def _layout_of(x: torch.Tensor) -> torch.memory_format:
    channels_last = x.is_contiguous(memory_format=torch.channels_last_3d) and not x.is_contiguous()
    return torch.channels_last_3d if channels_last else torch.contiguous_format


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, scale: float, silu: bool) -> torch.Tensor:
    """`F.normalize(x, dim=1) * scale * gamma`, then SiLU if asked.

    The channel norm is accumulated in float32 without a float32 copy of the activation: at
    480x832 these tensors are hundreds of MB and the VAE is memory-bound around its norms.
    A pure function so that one `torch.compile` of it can serve every norm (`fuse_norms`).
    """
    norm = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32)
    inv = norm.clamp_min(NORM_EPS).reciprocal().mul(scale).to(x.dtype)
    y = (x * inv).mul_(gamma)
    return F.silu(y, inplace=True) if silu else y


class RMSNorm(nn.Module):
    """RMS norm over channels with a learned per-channel gain (see `rms_norm`)."""

    def __init__(self, dim: int, spatial_dims: int) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *([1] * spatial_dims)))
        self.kernel = rms_norm

    def forward(self, x: torch.Tensor, silu: bool = False) -> torch.Tensor:
        return self.kernel(x, self.gamma, self.scale, silu)


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(in_dim, 3)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = RMSNorm(out_dim, 3)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x, cache)
        x = self.conv1(self.norm1(x, silu=True), cache)
        x = self.conv2(self.norm2(x, silu=True), cache)
        return x.add_(shortcut)


class AttentionBlock(nn.Module):
    """Single-head self-attention over the H*W positions of each frame separately; `form`: torch's
    attention kernel (`kernel`) or two matrix products around a softmax (`matmul`, see
    `engine.layers.attention.matmul_attention`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, 2)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)
        self.form = "kernel"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        qkv = self.to_qkv(self.norm(frames)).reshape(b * t, 1, 3 * c, h * w).transpose(2, 3)
        q, k, v = qkv.chunk(3, dim=-1)
        if self.form == "matmul":
            y = matmul_attention(q.squeeze(1), k.squeeze(1), v.squeeze(1))
        else:
            y = F.scaled_dot_product_attention(q, k, v).squeeze(1)
        y = y.transpose(1, 2).reshape(b * t, c, h, w)
        y = self.proj(y).view(b, t, c, h, w).transpose(1, 2)
        return y.add_(x)


class MidBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = self.resnets[0](x, cache)
        x = self.attentions[0](x)
        return self.resnets[1](x, cache)


class Resample(nn.Module):
    """Spatial x2 up/down-sampling per frame, optionally with causal temporal x2 (`...3d` modes).

    Temporal downsampling: a stride-2 conv over (previous frame, two new frames); the stream's
    first frame passes through alone. Temporal upsampling: a causal conv doubles channels, which
    are split into two frames; again the stream's first frame is passed through as one frame.
    The spatial upsampling (nearest x2, then a 3x3 conv) can run as phase convolutions on the
    low-resolution frames (`use_upsample`; the checkpoint keeps the 3x3 conv).
    """

    MODES = ("upsample2d", "upsample3d", "downsample2d", "downsample3d")

    def __init__(self, dim: int, mode: str) -> None:
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"Resample mode {mode!r}; allowed: {self.MODES}")
        self.mode = mode
        self.cache_key = ""
        self.phase: PhaseUpsampleConv | None = None
        if mode.startswith("upsample"):
            up = nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact")
            self.resample = nn.Sequential(up, nn.Conv2d(dim, dim // 2, 3, padding=1))
        else:
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=(2, 2)))
        if mode == "upsample3d":
            self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))
        elif mode == "downsample3d":
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        if self.mode == "upsample3d":
            x = self._double_frames(x, cache)
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        y = self.resample(frames) if self.phase is None else self.phase(frames)
        x = y.view(b, t, *y.shape[1:]).transpose(1, 2)
        if self.mode == "downsample3d":
            x = self._halve_frames(x, cache)
        return x

    def use_upsample(self, kind: str) -> None:
        """How the spatial upsampling runs: `nearest` (upsample, then the 3x3 conv), or one of the
        phase forms of `engine.layers.phase_upsample`, derived from the current weights."""
        if kind not in UPSAMPLE_KINDS:
            raise ValueError(f"Resample upsample kind {kind!r}; allowed: {UPSAMPLE_KINDS}")
        if not self.mode.startswith("upsample"):
            raise ValueError(f"Resample.use_upsample: this resampler is a {self.mode}")
        self.phase = None if kind == "nearest" else PhaseUpsampleConv(self.resample[1], kind)

    def _double_frames(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        head = None
        if not cache.started:
            head, x = x[:, :, :1], x[:, :, 1:]
            if x.shape[2] == 0:  # the first latent alone: the time conv starts from zeros at the next
                cache.start_zero(self.time_conv.cache_key, head, self.time_conv.history)
                return head
        y = self.time_conv(x, cache)
        b, c2, t, h, w = y.shape
        c = c2 // 2
        # Channel half k of frame i becomes frame 2i+k, written once in y's memory layout (a
        # channels-last y would otherwise come out contiguous and be converted again by the next conv).
        out = torch.empty((b, c, 2 * t, h, w), dtype=y.dtype, device=y.device, memory_format=_layout_of(y))
        out.view(b, c, t, 2, h, w).copy_(y.view(b, 2, c, t, h, w).permute(0, 2, 3, 1, 4, 5))
        return out if head is None else torch.cat([head, out], dim=2)

    def _halve_frames(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        if cache.started:
            return cache.through(self.cache_key, x, 1, lambda whole: self.time_conv(whole, cache))
        cache.remember(self.cache_key, x, 1)
        if x.shape[2] == 1:
            return x
        return torch.cat([x[:, :, :1], self.time_conv(x, cache)], dim=2)


class UpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, upsample: str | None) -> None:
        super().__init__()
        dims = [in_dim] + [out_dim] * num_res_blocks
        self.resnets = nn.ModuleList([ResidualBlock(dims[i], out_dim) for i in range(num_res_blocks)])
        self.upsamplers = nn.ModuleList([Resample(out_dim, upsample)]) if upsample else None

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, cache)
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: WanVAEConfig) -> None:
        super().__init__()
        dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        self.conv_in = CausalConv3d(PIXEL_CHANNELS, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(cfg.num_res_blocks):
                blocks.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if level < len(cfg.dim_mult) - 1:
                mode = "downsample3d" if cfg.temporal_downsample[level] else "downsample2d"
                blocks.append(Resample(out_dim, mode))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = RMSNorm(dims[-1], 3)
        self.conv_out = CausalConv3d(dims[-1], cfg.z_dim * 2, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = self.conv_in(x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out(self.norm_out(x, silu=True), cache)


class Decoder(nn.Module):
    def __init__(self, cfg: WanVAEConfig) -> None:
        super().__init__()
        dims = [cfg.base_dim * m for m in (cfg.dim_mult[-1], *reversed(cfg.dim_mult))]
        temporal_upsample = tuple(reversed(cfg.temporal_downsample))
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0])
        blocks = []
        for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:])):
            if level > 0:
                in_dim //= 2  # the previous level's upsampler halves channels
            upsample = None
            if level < len(cfg.dim_mult) - 1:
                upsample = "upsample3d" if temporal_upsample[level] else "upsample2d"
            blocks.append(UpBlock(in_dim, out_dim, cfg.num_res_blocks + 1, upsample))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = RMSNorm(dims[-1], 3)
        self.conv_out = CausalConv3d(dims[-1], PIXEL_CHANNELS, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: FrameCache) -> torch.Tensor:
        x = self.conv_in(x, cache)
        x = self.mid_block(x, cache)
        for block in self.up_blocks:
            x = block(x, cache)
        return self.conv_out(self.norm_out(x, silu=True), cache)


class WanVAE(nn.Module):
    """Wan2.1 VAE. Pixels are [B, 3, T, H, W] in [-1, 1]; latents [B, z_dim, T', H/8, W/8].

    One-shot: `encode` takes T = 1 + 4k frames, `decode` returns 1 + 4(T'-1) frames.
    Streaming: `encode_stream` takes 1 + 4k frames on a stream's first call and 4k after;
    `decode_stream` takes any number of latents (the stream's first latent gives 1 frame, every
    other latent 4). Both equal the one-shot result on the concatenated stream.
    """

    def __init__(self, cfg: WanVAEConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or VAE_PRESETS["wan2.1"]
        z = self.cfg.z_dim
        self.encoder = Encoder(self.cfg)
        self.quant_conv = CausalConv3d(z * 2, z * 2, 1)
        self.post_quant_conv = CausalConv3d(z, z, 1)
        self.decoder = Decoder(self.cfg)
        for name, module in self.named_modules():
            if isinstance(module, (CausalConv3d, Resample)):
                module.cache_key = name
        self.memory_format = torch.preserve_format  # of the chunks going in (`use_channels_last`)
        self.io_dtype: torch.dtype | None = None  # of the latents and frames handed back (`use_io_dtype`)
        self._saved_steps: tuple[SavedCompile, SavedCompile] | None = None  # (encoder, decoder): `compile_step`
        self._set_latent_stats(None)

    def _set_latent_stats(self, device: torch.device | str | None) -> None:
        """Latent mean/std are config constants, kept as non-persistent buffers (not in checkpoints)."""
        shape = (1, self.cfg.z_dim, 1, 1, 1)
        for name in ("latents_mean", "latents_std"):
            values = torch.tensor(getattr(self.cfg, name), dtype=torch.float32, device=device)
            self.register_buffer(name, values.view(shape), persistent=False)

    @classmethod
    def from_checkpoint(cls, path: str | Path, cfg: WanVAEConfig | None = None, *,
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> WanVAE:
        """Build on the meta device and load strictly from `Wan2.1_VAE.pth` or a diffusers
        `AutoencoderKLWan` file/folder; any missing, unexpected or mis-shaped key is an error."""
        from loom_live.engine.models import vae_convert

        files = checkpoint_files(path)
        with torch.device("meta"):
            model = cls(cfg)
        seen: list[str] = []

        def rename(key: str) -> str | None:
            seen.append(key)
            return vae_convert.wan_key_to_native(key, model.cfg)

        try:
            load_into_module(model, files, rename, device=device, dtype=dtype)
        except CheckpointError as exc:
            raise CheckpointError(vae_convert.explain_mismatch(str(exc), seen, "a Wan2.1 VAE")) from exc
        model._set_latent_stats(device)
        return model.eval().requires_grad_(False)

    def new_stream_state(self) -> VAEStreamState:
        return VAEStreamState()

    def use_upsample(self, kind: str) -> None:
        """How the decoder's spatial upsamplers run (`UPSAMPLE_KINDS`; `phase` and `transposed` do
        16 instead of 36 multiply-adds per low-resolution pixel and equal `nearest` up to float
        rounding). Their weights are derived from the current 3x3 weights: call after loading."""
        for module in self.decoder.modules():
            if isinstance(module, Resample):
                module.use_upsample(kind)

    def use_attention(self, form: str) -> None:
        """How the mid blocks' single-head attention runs (`ATTENTION_FORMS`): torch's kernel, or as
        two matrix products with float32 scores; the same result up to float rounding."""
        if form not in ATTENTION_FORMS:
            raise ValueError(f"WanVAE.use_attention: form {form!r}; allowed: {', '.join(ATTENTION_FORMS)}")
        for module in self.modules():
            if isinstance(module, AttentionBlock):
                module.form = form

    def use_thin_convs(self, kinds: tuple[str, ...] = THIN_KINDS, stack_upto: int = THIN_CHANNELS) -> None:
        """Run the convs with a few channels on one side (the encoder's first: `stack`, the decoder's
        last: `taps`) in the forms of `engine.layers.thin_conv` named in `kinds` (empty: as
        written), derived from the current weights: call after loading. `stack_upto` widens `stack`
        to every fitting conv with at most that many input channels (96: the full-resolution ones).
        The same result up to float rounding."""
        unknown = set(kinds) - set(THIN_KINDS)
        if unknown:
            raise ValueError(f"WanVAE.use_thin_convs: unknown kinds {sorted(unknown)}; allowed: {THIN_KINDS}")
        for module in [m for m in self.modules() if isinstance(m, CausalConv3d)]:
            module.thin = ThinConv3d(module, kind) if (kind := thin_kind(module, stack_upto)) in kinds else None

    def use_channels_last(self, enabled: bool = True) -> None:
        """Channels-last weights and chunks (`channels_last_3d` for the 3D convs), or back to the
        default layout. The same arithmetic in another memory order: cuDNN's 3D convolutions are
        faster on channels-last tensors, and every layer keeps the layout it is given."""
        fmt3, fmt2 = (torch.channels_last_3d, torch.channels_last) if enabled else (torch.contiguous_format,) * 2
        for p in self.parameters():
            if p.dim() in (4, 5):
                p.data = p.data.contiguous(memory_format=fmt3 if p.dim() == 5 else fmt2)
        for module in list(self.modules()):  # derived weights re-derived in the new layout
            if isinstance(module, Resample) and module.phase is not None:
                module.use_upsample(module.phase.kind)
            if isinstance(module, CausalConv3d) and module.thin is not None:
                module.thin = ThinConv3d(module, module.thin.kind)
        self.memory_format = fmt3

    def use_io_dtype(self, dtype: torch.dtype | None) -> None:
        """The dtype the stream calls hand back (latents from `encode_stream`, frames from
        `decode_stream`); None: the VAE's own. A VAE that computes in another dtype than the model
        around it (the config's `vae.dtype`) converts at its edges, so the DiT and the frame mapper
        never see its dtype. What comes in is converted to the VAE's dtype either way."""
        self.io_dtype = dtype

    def fuse_norms(self) -> None:
        """Run every norm(+SiLU) as one compiled elementwise kernel instead of ~5 eager passes.

        A small, cheap compile (one per activation shape) of the part eager mode wastes most
        memory traffic on; the convolutions stay cuDNN's. Needs a working torch.compile backend.
        """
        fused = torch.compile(rms_norm, dynamic=False)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = fused

    def compile_step(self, tune: bool = False, saved: Path | None = None, build_saved: bool = True) -> None:
        """Compile the encoder and decoder whole (Inductor, static shapes).

        Beyond `fuse_norms`, this fuses each conv's bias add, the residual adds and the history
        concatenations into the neighbouring norm kernels, fewer passes over the activations
        (encode and decode timings in docs/performance.md). Each distinct chunk shape compiles
        once (tens of seconds), so callers keep the shapes few: the session runs steady steps one
        latent at a time (`VAEGraphs`) and compiles them in its warm-up. `tune` has Inductor time
        block sizes around its heuristic's for each fused kernel (coordinate descent): the norms
        are memory-bound passes over hundreds of MB, where the block shape sets the bandwidth
        reached; it lengthens a cold compile, and the compile cache keeps the choices. With a
        `saved` folder each compiled step is loaded from there whole instead of traced again
        (`SavedCompile`), and with `build_saved` a step not there yet is built and kept there (without,
        it compiles as it would with no folder); call it after the layout choices (`use_*`).
        """
        options = {"coordinate_descent_tuning": True} if tune else None
        self.encoder.compile(dynamic=False, options=options)
        self.decoder.compile(dynamic=False, options=options)
        if saved is not None:  # a step with no file runs the module's own compiled call above
            self._saved_steps = tuple(
                SavedCompile(type(part).forward, saved, f"wan_vae.{name}", build=build_saved, owner=part,
                             plain=_call_owner, options=options)
                for name, part in (("encoder", self.encoder), ("decoder", self.decoder)))

    @property
    def dtype(self) -> torch.dtype:
        return self.quant_conv.weight.dtype

    def encode_stream(self, x: torch.Tensor, state: VAEStreamState) -> torch.Tensor:
        """Encode the next chunk of a stream: 1 + 4k frames on the first call, 4k later -> k(+1) latents.

        A stream's first call runs the encoder's plain forward even after `compile_step`: it has its
        own shapes and an empty history, and compiling it would cost a graph of its own (tens of
        seconds cold, seconds warm) for a call made once per stream. A session sends the first frame
        alone (`VAEGraphs`), so that call is small; the decoder does the same with the first latent."""
        cache = state.encoder
        check_pixels(x, first=not cache.started, what="WanVAE.encode_stream")
        check_signature(cache, (x.shape[0], *x.shape[3:], x.device), "WanVAE.encode_stream")
        encoder = self.encoder.forward  # first call: plain (see this docstring)
        if cache.started:
            encoder = self.encoder if self._saved_steps is None else self._saved_steps[0]
        h = encoder(x.to(dtype=self.dtype, memory_format=self.memory_format), cache)
        cache.commit()  # after the compiled step, not in it (`FrameCache.through`)
        cache.started = True
        z = self.quant_conv(h, cache)[:, : self.cfg.z_dim]  # the posterior mean; log-variance unused
        if self.cfg.normalize_on_encode:
            z = ((z - self.latents_mean) / self.latents_std).to(z.dtype)
        return z if self.io_dtype is None else z.to(self.io_dtype)

    def decode_stream(self, z: torch.Tensor, state: VAEStreamState) -> torch.Tensor:
        """Decode the next latents of a stream: 4 frames each (1 for the stream's first latent)."""
        cache = state.decoder
        check_latents(z, self.cfg.z_dim, "WanVAE.decode_stream")
        check_signature(cache, (z.shape[0], *z.shape[3:], z.device), "WanVAE.decode_stream")
        z = z.to(dtype=self.dtype, memory_format=self.memory_format)
        if self.cfg.denormalize_on_decode:
            z = (z * self.latents_std + self.latents_mean).to(z.dtype)
        decoder = self.decoder.forward  # first call: plain (see encode_stream)
        if cache.started:
            decoder = self.decoder if self._saved_steps is None else self._saved_steps[1]
        x = decoder(self.post_quant_conv(z, cache), cache)
        cache.commit()
        cache.started = True
        x = x.clamp_(-1.0, 1.0)
        return x if self.io_dtype is None else x.to(self.io_dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """One-shot encode of a whole clip (1 + 4k frames), run as a stream in bounded pieces."""
        check_pixels(x, first=True, what="WanVAE.encode")
        return encode_in_pieces(self.encode_stream, x, self.new_stream_state())

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """One-shot decode of a whole latent clip -> 1 + 4(T'-1) frames, clamped to [-1, 1]."""
        check_latents(z, self.cfg.z_dim, "WanVAE.decode")
        return decode_in_pieces(self.decode_stream, z, self.new_stream_state())


def _call_owner(owner: nn.Module, *args: object) -> torch.Tensor:
    """A `SavedCompile`'s step with no file: its owner's own (compiled) call."""
    return owner(*args)


def encode_in_pieces(encode_stream, x: torch.Tensor, state: VAEStreamState) -> torch.Tensor:
    step = TIME_STRIDE * ONE_SHOT_CHUNK_LATENTS
    pieces = [x[:, :, : 1 + step]] + list(x[:, :, 1 + step:].split(step, dim=2))
    return torch.cat([encode_stream(p, state) for p in pieces if p.shape[2]], dim=2)


def decode_in_pieces(decode_stream, z: torch.Tensor, state: VAEStreamState) -> torch.Tensor:
    return torch.cat([decode_stream(p, state) for p in z.split(ONE_SHOT_CHUNK_LATENTS, dim=2)], dim=2)


def check_pixels(x: torch.Tensor, first: bool, what: str) -> None:
    """Pixel chunks: [B, 3, T, H, W], H and W multiples of 8, T = 1 + 4k first and 4k after."""
    if not isinstance(x, torch.Tensor) or x.dim() != 5 or not x.is_floating_point():
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what}: expected a float tensor [B, 3, T, H, W] in [-1, 1], got {got}")
    b, c, t, h, w = x.shape
    if c != PIXEL_CHANNELS:
        raise ValueError(f"{what}: expected 3 (RGB) channels in dim 1 of [B, 3, T, H, W], got {c} "
                         f"(shape {tuple(x.shape)})")
    if h % SPACE_STRIDE or w % SPACE_STRIDE or h == 0 or w == 0:
        raise ValueError(f"{what}: height and width must be positive multiples of {SPACE_STRIDE}, "
                         f"got {h}x{w}")
    if first and t % TIME_STRIDE != 1:
        raise ValueError(f"{what}: the first chunk of a stream needs 1 + 4k frames (1, 5, 9, ...), got {t}")
    if not first and (t == 0 or t % TIME_STRIDE):
        raise ValueError(f"{what}: chunks after the first need a positive multiple of 4 frames, got {t}")


def check_latents(z: torch.Tensor, z_dim: int, what: str) -> None:
    if not isinstance(z, torch.Tensor) or z.dim() != 5 or not z.is_floating_point():
        got = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
        raise ValueError(f"{what}: expected a float latent tensor [B, {z_dim}, T, h, w], got {got}")
    if z.shape[1] != z_dim:
        raise ValueError(f"{what}: expected {z_dim} latent channels in dim 1, got {z.shape[1]} "
                         f"(shape {tuple(z.shape)})")
    if z.shape[2] == 0 or z.shape[3] == 0 or z.shape[4] == 0:
        raise ValueError(f"{what}: empty latent tensor {tuple(z.shape)}")
