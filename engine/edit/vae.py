"""The edit family's pixel <-> latent stage: a tiny autoencoder (the TAESD design DreamLite ships).

Pixels [-1, 1] -> 4-channel latents at 1/8 size and back, with plain 3x3 convolutions and ReLU
residual blocks: a few milliseconds per frame, so encode rides on the side stream and decode on
the main stream without either becoming the critical path. Names follow diffusers'
AutoencoderTiny (`encoder.layers.N`, `decoder.layers.N`).

Latent scaling follows DreamLiteMobilePipeline: the source latents go into the UNet as the
encoder gives them (unscaled), and the denoised latents are unscaled before decoding
(z / scaling_factor + shift_factor, from the autoencoder's config.json; 1 and 0 for TAESD).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

LATENT_CHANNELS = 4


@dataclass(frozen=True)
class TinyVAEConfig:
    channels: int = 64
    encoder_blocks: tuple[int, ...] = (1, 3, 3, 3)
    decoder_blocks: tuple[int, ...] = (3, 3, 3, 1)
    scaling_factor: float = 1.0
    shift_factor: float = 0.0

    @classmethod
    def from_file(cls, path: str | Path) -> TinyVAEConfig:
        """An AutoencoderTiny config.json (one channel width throughout, 4 latent channels)."""
        try:
            c: dict[str, Any] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable autoencoder config.json ({exc})") from exc
        widths = set(c.get("encoder_block_out_channels", (64,))) | set(c.get("decoder_block_out_channels", (64,)))
        if len(widths) != 1 or c.get("latent_channels", LATENT_CHANNELS) != LATENT_CHANNELS:
            raise ValueError(f"{path}: a tiny autoencoder of one channel width and {LATENT_CHANNELS} latent "
                             f"channels is expected, got widths {sorted(widths)}, "
                             f"latent_channels {c.get('latent_channels')}")
        return cls(channels=widths.pop(), encoder_blocks=tuple(c.get("num_encoder_blocks", (1, 3, 3, 3))),
                   decoder_blocks=tuple(c.get("num_decoder_blocks", (3, 3, 3, 1))),
                   scaling_factor=float(c.get("scaling_factor", 1.0)),
                   shift_factor=float(c.get("shift_factor") or 0.0))

    @property
    def scale(self) -> int:
        return 2 ** (len(self.encoder_blocks) - 1)


VAE_PRESETS = {"taesd": TinyVAEConfig(), "tiny": TinyVAEConfig(channels=8, encoder_blocks=(1, 1, 1, 1),
                                                                decoder_blocks=(1, 1, 1, 1))}


class _Block(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1), nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1),
                                  nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1))
        self.fuse = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fuse(self.conv(x) + x)


class _Encoder(nn.Module):
    def __init__(self, cfg: TinyVAEConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, n in enumerate(cfg.encoder_blocks):
            layers.append(nn.Conv2d(3, cfg.channels, 3, padding=1) if i == 0 else
                          nn.Conv2d(cfg.channels, cfg.channels, 3, stride=2, padding=1, bias=False))
            layers += [_Block(cfg.channels) for _ in range(n)]
        layers.append(nn.Conv2d(cfg.channels, LATENT_CHANNELS, 3, padding=1))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x.add(1).div(2))


class _Decoder(nn.Module):
    def __init__(self, cfg: TinyVAEConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(LATENT_CHANNELS, cfg.channels, 3, padding=1), nn.ReLU()]
        for i, n in enumerate(cfg.decoder_blocks):
            last = i == len(cfg.decoder_blocks) - 1
            layers += [_Block(cfg.channels) for _ in range(n)]
            if not last:
                layers.append(nn.Upsample(scale_factor=2))
            layers.append(nn.Conv2d(cfg.channels, 3 if last else cfg.channels, 3, padding=1, bias=last))
        self.layers = nn.Sequential(*layers)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.layers(torch.tanh(z / 3) * 3).mul(2).sub(1)


class TinyVAE(nn.Module):
    def __init__(self, cfg: TinyVAEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = _Encoder(cfg)
        self.decoder = _Decoder(cfg)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> [B, 4, H/8, W/8]."""
        return self.encoder(x)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """[B, 4, h, w] -> [B, 3, 8h, 8w] in about [-1, 1]."""
        return self.decoder(z)

    def decode_latents(self, z: torch.Tensor) -> torch.Tensor:
        """Denoised latents -> pixels, unscaled first as the DreamLite pipeline does."""
        cfg = self.cfg
        if cfg.scaling_factor != 1.0 or cfg.shift_factor != 0.0:
            z = z / cfg.scaling_factor + cfg.shift_factor
        return self.decoder(z)
