"""Tiny VAE for Wan2.1 latents, weight-compatible with TAEHV's `taew2_1.pth`, with a streaming state.

A much cheaper stand-in for the Wan VAE (2D convs only, a one-frame memory per block), for
when the full VAE costs too much of the frame budget. It works on raw (unnormalised) Wan2.1
latents, like TAEHV itself; the config's normalisation switches mean the same as WanVAE's.

Layout source: the public TAEHV project (github.com/madebyollin/taehv, `taehv.py`, read for
its structure, nothing copied). In words, with every conv a 3x3 padding-1 `nn.Conv2d` unless
said otherwise and all blocks applied to frames independently except where noted:

- `MemBlock(n)`: `conv` = [conv(2n -> n), ReLU, conv(n -> n), ReLU, conv(n -> n)] applied to
  the channel-concatenation (current frame, previous frame's block input; zeros before the
  first frame); output ReLU(conv(...) + current). With equal in/out widths the skip is identity
  (no weight). Keys `conv.0`, `conv.2`, `conv.4` (weight, bias).
- `TPool(n, s)`: concatenates `s` consecutive frames on channels and mixes them with a 1x1
  conv (n*s -> n, no bias); time shrinks by `s`. Key `conv.weight`.
- `TGrow(n, s)`: a 1x1 conv (n -> n*s, no bias) whose output channels split into `s`
  consecutive frames (earliest first). Key `conv.weight`.
- encoder (`nn.Sequential`, indices are the key prefixes): 0 conv(3 -> 64), 1 ReLU,
  2 TPool(64, 2), 3 conv(64 -> 64, stride 2, no bias), 4-6 MemBlock(64),
  7 TPool(64, 2), 8 conv(stride 2, no bias), 9-11 MemBlock(64),
  12 TPool(64, 1), 13 conv(stride 2, no bias), 14-16 MemBlock(64), 17 conv(64 -> 16).
- decoder: 0 Clamp (3 * tanh(x / 3)), 1 conv(16 -> 256), 2 ReLU, 3-5 MemBlock(256),
  6 Upsample x2 (nearest), 7 TGrow(256, 1), 8 conv(256 -> 128, no bias), 9-11 MemBlock(128),
  12 Upsample x2, 13 TGrow(128, 2), 14 conv(128 -> 64, no bias), 15-17 MemBlock(64),
  18 Upsample x2, 19 TGrow(64, 2), 20 conv(64 -> 64, no bias), 21 ReLU, 22 conv(64 -> 3).
- pixels are NTCHW in [0, 1] there (Loom converts from [B, 3, T, H, W] in [-1, 1]); every
  4 input frames give one latent, every latent decodes to 4 frames, and the decoder drops its
  first 3 output frames so that latents line up with the Wan VAE (1 + 4k <-> 1 + k).

Stream alignment: TAEHV's own one-shot encoder groups frames (0-3), (4-7), ... and pads the
end of the clip by repeating the last frame, so its latent j, meant to stand for Wan's
latent j (frames 4j-3..4j), already looks 3 frames ahead. A live stream cannot wait for frames
that have not arrived, so Loom pads the *start* instead: the first frame is repeated 3 times
in front, giving groups (0,0,0,0), (1-4), (5-8), ... A 1 + 4k chunk then yields exactly
1 + k latents and every later 4k chunk k latents. The price is the same 3 frames either way:
TAEHV's grouping would wait for them, this one shows content 3 frames late (the encoder
treats its newest frame as the 4th of a group that Wan would end 3 frames earlier).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from loom_live.engine.cache.vae_cache import FrameCache, VAEStreamState, check_signature
from loom_live.engine.models.checkpoint_io import CheckpointError, checkpoint_files, load_into_module
from loom_live.engine.models.wan_vae import (
    TIME_STRIDE,
    WAN21_LATENTS_MEAN,
    WAN21_LATENTS_STD,
    check_latents,
    check_pixels,
    decode_in_pieces,
    encode_in_pieces,
)

DECODER_TRIM = TIME_STRIDE - 1  # decoder outputs dropped at the start of a stream


@dataclass(frozen=True)
class TinyVAEConfig:
    latent_channels: int = 16
    encoder_width: int = 64
    decoder_widths: tuple[int, int, int, int] = (256, 128, 64, 64)
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    normalize_on_encode: bool = False
    denormalize_on_decode: bool = False

    @property
    def z_dim(self) -> int:
        return self.latent_channels


TINY_VAE_PRESETS: dict[str, TinyVAEConfig] = {"taew2.1": TinyVAEConfig()}


def _conv(cin: int, cout: int, **kwargs) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, padding=1, **kwargs)


class Clamp(nn.Module):
    """Soft clamp of latents to about +-3."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemBlock(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(_conv(2 * n, n), nn.ReLU(inplace=True), _conv(n, n), nn.ReLU(inplace=True),
                                  _conv(n, n))

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(torch.cat([x, past], dim=1)).add_(x))


class TPool(nn.Module):
    def __init__(self, n: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n * stride, n, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, c, h, w = x.shape
        return self.conv(x.reshape(-1, self.stride * c, h, w))


class TGrow(nn.Module):
    def __init__(self, n: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(n, n * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, c, h, w = x.shape
        return self.conv(x).reshape(-1, c, h, w)


def _encoder(cfg: TinyVAEConfig) -> nn.Sequential:
    n = cfg.encoder_width
    layers: list[nn.Module] = [_conv(3, n), nn.ReLU(inplace=True)]
    for pool in (2, 2, 1):
        layers += [TPool(n, pool), _conv(n, n, stride=2, bias=False), MemBlock(n), MemBlock(n), MemBlock(n)]
    return nn.Sequential(*layers, _conv(n, cfg.latent_channels))


def _decoder(cfg: TinyVAEConfig) -> nn.Sequential:
    n = cfg.decoder_widths
    layers: list[nn.Module] = [Clamp(), _conv(cfg.latent_channels, n[0]), nn.ReLU(inplace=True)]
    for level, grow in enumerate((1, 2, 2)):
        layers += [MemBlock(n[level]), MemBlock(n[level]), MemBlock(n[level]), nn.Upsample(scale_factor=2),
                   TGrow(n[level], grow), _conv(n[level], n[level + 1], bias=False)]
    return nn.Sequential(*layers, nn.ReLU(inplace=True), _conv(n[3], 3))


class TinyVAE(nn.Module):
    """TAEHV-layout tiny VAE with the same interface as `WanVAE` (see that class for the contract)."""

    def __init__(self, cfg: TinyVAEConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg or TINY_VAE_PRESETS["taew2.1"]
        self.encoder = _encoder(self.cfg)
        self.decoder = _decoder(self.cfg)
        self._set_latent_stats(None)

    def _set_latent_stats(self, device: torch.device | str | None) -> None:
        shape = (1, self.cfg.latent_channels, 1, 1, 1)
        for name in ("latents_mean", "latents_std"):
            values = torch.tensor(getattr(self.cfg, name), dtype=torch.float32, device=device)
            self.register_buffer(name, values.view(shape), persistent=False)

    @classmethod
    def from_checkpoint(cls, path: str | Path, cfg: TinyVAEConfig | None = None, *,
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> TinyVAE:
        """Load `taew2_1.pth` / `taew2_1.safetensors` strictly (keys are the TAEHV names)."""
        from loom_live.engine.models import vae_convert

        files = checkpoint_files(path)
        with torch.device("meta"):
            model = cls(cfg)
        seen: list[str] = []

        def rename(key: str) -> str:
            seen.append(key)
            return key

        try:
            load_into_module(model, files, rename, device=device, dtype=dtype)
        except CheckpointError as exc:
            raise CheckpointError(vae_convert.explain_mismatch(str(exc), seen, "a TAEHV tiny VAE")) from exc
        model._set_latent_stats(device)
        return model.eval().requires_grad_(False)

    def new_stream_state(self) -> VAEStreamState:
        return VAEStreamState()

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder[0].weight.dtype

    def encode_stream(self, x: torch.Tensor, state: VAEStreamState) -> torch.Tensor:
        cache = state.encoder
        first = not cache.started
        check_pixels(x, first=first, what="TinyVAE.encode_stream")
        check_signature(cache, (x.shape[0], *x.shape[3:], x.device), "TinyVAE.encode_stream")
        frames = x.to(self.dtype).add(1.0).mul_(0.5).transpose(1, 2)  # [B, T, 3, H, W] in [0, 1]
        if first:
            frames = torch.cat([frames[:, :1].expand(-1, DECODER_TRIM, -1, -1, -1), frames], dim=1)
        z = self._run(self.encoder, frames, cache, "encoder").transpose(1, 2)
        cache.started = True
        if self.cfg.normalize_on_encode:
            z = ((z - self.latents_mean) / self.latents_std).to(z.dtype)
        return z

    def decode_stream(self, z: torch.Tensor, state: VAEStreamState) -> torch.Tensor:
        cache = state.decoder
        check_latents(z, self.cfg.latent_channels, "TinyVAE.decode_stream")
        check_signature(cache, (z.shape[0], *z.shape[3:], z.device), "TinyVAE.decode_stream")
        z = z.to(self.dtype)
        if self.cfg.denormalize_on_decode:
            z = (z * self.latents_std + self.latents_mean).to(z.dtype)
        frames = self._run(self.decoder, z.transpose(1, 2), cache, "decoder")
        if not cache.started:
            frames = frames[:, DECODER_TRIM:]
        cache.started = True
        return frames.clamp(0.0, 1.0).mul_(2.0).sub_(1.0).transpose(1, 2)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        check_pixels(x, first=True, what="TinyVAE.encode")
        return encode_in_pieces(self.encode_stream, x, self.new_stream_state())

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        check_latents(z, self.cfg.latent_channels, "TinyVAE.decode")
        return decode_in_pieces(self.decode_stream, z, self.new_stream_state())

    @staticmethod
    def _run(blocks: nn.Sequential, x: torch.Tensor, cache: FrameCache, name: str) -> torch.Tensor:
        """Apply the block list to [B, T, C, H, W] frames of one chunk, all frames at once.

        Frames stay in one [B*T, C, H, W] batch; a MemBlock's "previous frame" input is the
        chunk shifted by one frame in time, with the last frame of the previous chunk in front.
        """
        batch = x.shape[0]
        h = x.flatten(0, 1)
        for index, block in enumerate(blocks):
            if isinstance(block, MemBlock):
                seq = h.unflatten(0, (batch, -1))
                past = cache.extend(f"{name}.{index}", seq, 1, dim=1)[:, :-1]
                h = block(h, past.flatten(0, 1))
            else:
                h = block(h)
        return h.unflatten(0, (batch, -1))
