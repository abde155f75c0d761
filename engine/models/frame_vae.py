"""The embedded model's VAE: a per-frame autoencoder whose latent frame packs four video frames.

Why this shape: the embedded default must reconstruct colour and detail well enough that a restyle
through it is sharp, learn that in minutes, and run on a CPU. Temporal compression is what a tiny
model learns slowest and loses most on fast motion, and a narrow ReLU layer at full resolution can
drop whole colour directions for good. So each frame is coded on its own: every 8x8 pixel block
becomes `frame_channels` values (96: half of the block's 192), through a linear block codec plus a
small convolutional residual that starts at zero. Training thus begins from a linear codec (the
recipe sets it to the blocks' principal components) that already keeps colour, and the residual
learns edges and texture. Thin lines and hard colour borders anywhere in a block are what a narrower
code loses first, so the code is as wide as the line styles need.

The Wan stream geometry stays, so the session, the KV cache and the DiT need no special case: a
latent frame stands for four video frames, their codes side by side on the channel axis (earliest
first), and the first latent of a stream stands for frame 0 alone (its three earlier slots repeat
frame 0; the decoder drops what they decode). A 1 + 4k frame chunk gives 1 + k latents and every
later 4k chunk k latents, and a latent decodes to exactly the frames it was made of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loom_live.engine.cache.vae_cache import VAEStreamState, check_signature
from loom_live.engine.models.wan_vae import (
    PIXEL_CHANNELS,
    SPACE_STRIDE,
    TIME_STRIDE,
    check_latents,
    check_pixels,
    decode_in_pieces,
    encode_in_pieces,
)

BLOCK_VALUES = PIXEL_CHANNELS * SPACE_STRIDE * SPACE_STRIDE  # one 8x8 RGB block, flattened
LEAD = TIME_STRIDE - 1  # copies of frame 0 in front of a stream


@dataclass(frozen=True)
class FrameVAEConfig:
    frame_channels: int = 96  # code values per 8x8 block of one frame
    encoder_width: int = 96
    decoder_width: int = 128
    upsample_width: int = 32  # the decoder's last stage, at a quarter of the frame's side
    latents_mean: tuple[float, ...] = ()  # per latent channel; empty: 0
    latents_std: tuple[float, ...] = ()  # empty: 1
    normalize_on_encode: bool = True
    denormalize_on_decode: bool = True

    @property
    def latent_channels(self) -> int:
        return self.frame_channels * TIME_STRIDE

    @property
    def z_dim(self) -> int:
        return self.latent_channels


def _conv(cin: int, cout: int, k: int = 3) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, padding=k // 2)


def _zero(conv: nn.Conv2d) -> nn.Conv2d:
    nn.init.zeros_(conv.weight)
    nn.init.zeros_(conv.bias)
    return conv


class ResBlock(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = _conv(n, n), _conv(n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.silu(self.conv1(F.silu(x))))


class FrameEncoder(nn.Module):
    """[N, 3, H, W] in [-1, 1] -> [N, frame_channels, H/8, W/8]."""

    def __init__(self, cfg: FrameVAEConfig) -> None:
        super().__init__()
        w, c = cfg.encoder_width, cfg.frame_channels
        self.linear = _conv(BLOCK_VALUES, c, 1)
        self.body = nn.Sequential(_conv(BLOCK_VALUES, w), nn.SiLU(), _conv(w, w), nn.SiLU(), _zero(_conv(w, c)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = F.pixel_unshuffle(x, SPACE_STRIDE)
        return self.linear(blocks) + self.body(blocks)


class FrameDecoder(nn.Module):
    """[N, frame_channels, h, w] -> [N, 3, 8h, 8w] (not clamped)."""

    def __init__(self, cfg: FrameVAEConfig) -> None:
        super().__init__()
        c, w, u = cfg.frame_channels, cfg.decoder_width, cfg.upsample_width
        self.linear = _conv(c, BLOCK_VALUES, 1)
        self.body = nn.Sequential(
            _conv(c, w), ResBlock(w), nn.SiLU(), _conv(w, 4 * u, 1), nn.PixelShuffle(2),  # side x2
            nn.SiLU(), _conv(u, u), nn.SiLU(), _zero(_conv(u, PIXEL_CHANNELS * 16, 1)), nn.PixelShuffle(4))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return F.pixel_shuffle(self.linear(z), SPACE_STRIDE) + self.body(z)


class FrameVAE(nn.Module):
    """Same interface as `WanVAE` and `TinyVAE` (see `WanVAE` for the streaming contract)."""

    def __init__(self, cfg: FrameVAEConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or FrameVAEConfig()
        self.encoder = FrameEncoder(self.cfg)
        self.decoder = FrameDecoder(self.cfg)
        self._set_latent_stats(None)

    def _set_latent_stats(self, device: torch.device | str | None) -> None:
        n = self.cfg.latent_channels
        mean = self.cfg.latents_mean or (0.0,) * n
        std = self.cfg.latents_std or (1.0,) * n
        if len(mean) != n or len(std) != n:
            raise ValueError(f"FrameVAEConfig: latents_mean and latents_std need {n} values each, "
                             f"got {len(mean)} and {len(std)}")
        for name, values in (("latents_mean", mean), ("latents_std", std)):
            t = torch.tensor(values, dtype=torch.float32, device=device).view(1, n, 1, 1, 1)
            self.register_buffer(name, t, persistent=False)

    def new_stream_state(self) -> VAEStreamState:
        return VAEStreamState()

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.linear.weight.dtype

    def encode_stream(self, x: torch.Tensor, state: VAEStreamState) -> torch.Tensor:
        """[B, 3, T, H, W] pixels in [-1, 1] (1 + 4k frames first, 4k after) -> [B, C, T', H/8, W/8]."""
        cache = state.encoder
        first = not cache.started
        check_pixels(x, first=first, what="FrameVAE.encode_stream")
        check_signature(cache, (x.shape[0], *x.shape[3:], x.device), "FrameVAE.encode_stream")
        frames = x.to(self.dtype).transpose(1, 2)  # [B, T, 3, H, W]
        if first:
            frames = torch.cat([frames[:, :1].expand(-1, LEAD, -1, -1, -1), frames], dim=1)
        b, t = frames.shape[:2]
        codes = self.encoder(frames.flatten(0, 1))  # [B*T, c, h, w]
        z = codes.unflatten(0, (b, t // TIME_STRIDE, TIME_STRIDE)).flatten(2, 3).transpose(1, 2)
        cache.started = True
        if self.cfg.normalize_on_encode:
            z = ((z - self.latents_mean) / self.latents_std).to(z.dtype)
        return z

    def decode_stream(self, z: torch.Tensor, state: VAEStreamState, clamp: bool = True) -> torch.Tensor:
        """[B, C, T', h, w] -> [B, 3, 4T' (first chunk: 4T' - 3), 8h, 8w]; `clamp=False` keeps the
        raw output (training: the clamp would stop the gradient of out-of-range pixels)."""
        cache = state.decoder
        check_latents(z, self.cfg.latent_channels, "FrameVAE.decode_stream")
        check_signature(cache, (z.shape[0], *z.shape[3:], z.device), "FrameVAE.decode_stream")
        z = z.to(self.dtype)
        if self.cfg.denormalize_on_decode:
            z = (z * self.latents_std + self.latents_mean).to(z.dtype)
        b, _, t, h, w = z.shape
        codes = z.transpose(1, 2).reshape(b * t * TIME_STRIDE, self.cfg.frame_channels, h, w)
        frames = self.decoder(codes).unflatten(0, (b, t * TIME_STRIDE))
        if not cache.started:
            frames = frames[:, LEAD:]
        cache.started = True
        frames = frames.transpose(1, 2)
        return frames.clamp(-1.0, 1.0) if clamp else frames

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        check_pixels(x, first=True, what="FrameVAE.encode")
        return encode_in_pieces(self.encode_stream, x, self.new_stream_state())

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        check_latents(z, self.cfg.latent_channels, "FrameVAE.decode")
        return decode_in_pieces(self.decode_stream, z, self.new_stream_state())
