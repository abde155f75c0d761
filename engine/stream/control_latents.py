"""VACE control latents from control frames, and the reference image's conditioning entry.

Wan2.1-VACE reads 96 channels per latent frame: the VAE latents of the control video's inactive part
(the pixels to keep: zero where the mask is one), of its reactive part (the pixels to generate from),
and the pixel mask folded 8x8 into 64 channels. A live stream controls every pixel, so the mask is
all ones, the reactive part is the control video and the inactive part is a grey (zero) video. Each
part is encoded by the stream's own VAE with a stream state of its own, chunk by chunk beside the
input (the grey part too: its latents keep changing for many chunks while the VAE's causal history
fills, so they are not taken as constant).
"""

from __future__ import annotations

import torch

from loom_live.engine.models.wan_vace import MASK_CHANNELS


class ControlEncoder:
    """Control frames [N, 3, H, W] in [-1, 1] to control latents [1, 96, f, h, w], chunk by chunk."""

    def __init__(self, encoder, layout: torch.memory_format = torch.contiguous_format) -> None:
        self.encoder = encoder
        self.layout = layout
        self.reactive = encoder.new_stream_state()
        self.inactive = encoder.new_stream_state()

    def reset(self) -> None:
        self.reactive.reset()
        self.inactive.reset()

    def latents(self, control: torch.Tensor) -> torch.Tensor:
        pixels = control.permute(1, 0, 2, 3)[None].contiguous(memory_format=self.layout)
        reactive = self.encoder.encode_stream(pixels, self.reactive)
        inactive = self.encoder.encode_stream(torch.zeros_like(pixels), self.inactive)
        mask = reactive.new_ones(1, MASK_CHANNELS, *reactive.shape[2:])
        return torch.cat((inactive.to(reactive.dtype), reactive, mask), dim=1)

    def reference(self, image: torch.Tensor) -> torch.Tensor:
        """One model-size image [1, 3, H, W] in [-1, 1] to its latent [1, 16, 1, h, w] (encoded alone)."""
        state = self.encoder.new_stream_state()
        return self.encoder.encode_stream(image.permute(1, 0, 2, 3)[None].contiguous(memory_format=self.layout),
                                          state)
