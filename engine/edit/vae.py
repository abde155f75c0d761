"""The edit family's pixel <-> latent stage: a tiny autoencoder (the TAESD design DreamLite ships).

Pixels [-1, 1] -> 4-channel latents at 1/8 size and back, with plain 3x3 convolutions and ReLU
residual blocks: a few milliseconds per frame, so encode rides on the side stream and decode on
the main stream without either becoming the critical path. Names follow diffusers'
AutoencoderTiny (`encoder.layers.N`, `decoder.layers.N`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

LATENT_CHANNELS = 4


@dataclass(frozen=True)
class TinyVAEConfig:
    channels: int = 64
    encoder_blocks: tuple[int, ...] = (1, 3, 3, 3)
    decoder_blocks: tuple[int, ...] = (3, 3, 3, 1)

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
