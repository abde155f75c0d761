"""VACE control latents from control frames, and the reference image's conditioning entry.

Wan2.1-VACE reads 96 channels per latent frame: the VAE latents of the control video's inactive part
(the pixels to keep: zero where the mask is one), of its reactive part (the pixels to generate from),
and the pixel mask folded 8x8 into 64 channels. A live stream controls every pixel, so the mask is
all ones, the reactive part is the control video and the inactive part is a grey (zero) video. The
reactive part is encoded by the stream's own VAE with a stream state of its own, chunk by chunk beside
the input. The grey part's latents depend on nothing but their place in the stream, so `ZeroLatents`
encodes them once and every stream reads them back (an encode per chunk saved on the GPU's side stream).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from loom_live.engine.models.wan_vace import MASK_CHANNELS
from loom_live.engine.models.wan_vae import TIME_STRIDE
from loom_live.engine.stream.frames import vae_pixels

log = logging.getLogger(__name__)

MEMO_LIMIT = 64  # zero-part latents kept while no fixed point has come (the Wan VAE's comes within 30)


EncodeRunner = Callable[[Callable, torch.Tensor, object], torch.Tensor]


def _direct(fn: Callable, x: torch.Tensor, state: object) -> torch.Tensor:
    return fn(x, state)


class ControlEncoder:
    """Control frames [N, 3, H, W] in [-1, 1] to control latents [1, 96, f, h, w], chunk by chunk.

    `run(encode_stream, pixels, state)` runs the reactive encode; a session passes its `VAEGraphs`, so
    the control video's steady chunks replay the same one-latent CUDA graph whatever chunk size the
    scheduler picks (no new shape, and so no capture or cuDNN tuning, mid-show)."""

    def __init__(self, encoder, layout: torch.memory_format = torch.contiguous_format,
                 run: EncodeRunner = _direct) -> None:
        self.encoder = encoder
        self.layout = layout
        self.run = run
        self.reactive = encoder.new_stream_state()
        self.inactive = ZeroLatents(encoder, layout)

    def reset(self) -> None:
        self.reactive.reset()
        self.inactive.reset()

    def pixels(self, control: torch.Tensor) -> torch.Tensor:
        """Control frames [N, 3, H, W] as the VAE's input [1, 3, N, H, W]."""
        return vae_pixels(control, self.layout)

    def latents(self, control: torch.Tensor) -> torch.Tensor:
        pixels = self.pixels(control)
        return self.assemble(self.run(self.encoder.encode_stream, pixels, self.reactive), pixels)

    def assemble(self, reactive: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        """The 96 channels from the reactive part's latents (encoded here or, batched with the input's
        encode, by the session) and the grey part's at this place in the stream."""
        inactive = self.inactive.next(pixels)
        mask = reactive.new_ones(1, MASK_CHANNELS, *reactive.shape[2:])
        return torch.cat((inactive.to(reactive.dtype), reactive, mask), dim=1)

    def reference(self, image: torch.Tensor) -> torch.Tensor:
        """One model-size image [1, 3, H, W] in [-1, 1] to its latent [1, 16, 1, h, w] (encoded alone)."""
        state = self.encoder.new_stream_state()
        return self.encoder.encode_stream(vae_pixels(image, self.layout), state)


class ZeroLatents:
    """The latents of an all-zero video, by their place in the stream, encoded once for every stream.

    A causal VAE's output for a chunk depends on the chunk and on the history its layers keep; with
    zeros in, both depend only on the place in the stream. So the latents are encoded one at a time
    on a stream state of this object's own (`encodes` counts them), kept, and read back by every
    later stream (`reset`). Once a step leaves that history exactly as it found it, the history is a
    fixed point and every later latent equals that step's: from then on nothing is encoded at all
    and the history's memory is given back. A VAE without such a point within MEMO_LIMIT latents still costs
    nothing extra: past the limit the stream's latents are encoded live from the kept history.
    Chunks of several latents get the same latents as one at a time, up to float rounding.
    """

    def __init__(self, encoder, layout: torch.memory_format = torch.contiguous_format) -> None:
        self.encoder = encoder
        self.layout = layout
        self.position = 0  # the reading stream's next latent
        self.encodes = 0  # steps encoded so far (the saving shows as this staying put)
        self._clear(None)

    def _clear(self, key: tuple | None) -> None:
        self._key = key
        self.kept: list[torch.Tensor] = []
        self.steady_from: int | None = None  # first latent of the fixed point
        self._state = self.encoder.new_stream_state()
        self._limit_state = None  # the history at MEMO_LIMIT, when no fixed point came before it

    def reset(self) -> None:
        self.position = 0

    def next(self, like: torch.Tensor) -> torch.Tensor:
        """Latents of a zero chunk shaped as `like` ([B, 3, T, H, W]) at this stream's place."""
        key = (like.shape[0], *like.shape[3:], like.dtype, like.device)
        if key != self._key:  # another size (a new model resolution): new latents
            self._clear(key)
        frames = like.shape[2]
        count = (frames - 1) // TIME_STRIDE + 1 if self.position == 0 else frames // TIME_STRIDE
        start, self.position = self.position, self.position + count
        return torch.cat([self._latent(i, like) for i in range(start, start + count)], dim=2)

    def _latent(self, i: int, like: torch.Tensor) -> torch.Tensor:
        if i < len(self.kept):
            return self.kept[i]
        if self.steady_from is not None:
            return self.kept[self.steady_from]
        if i < MEMO_LIMIT:
            self.kept.append(self._step(like, check=i > 0))
            if self.steady_from is not None:
                log.info("control: the grey part's latents are constant from latent %d on; no more encodes", i)
            return self.kept[i]
        if self._limit_state is None:
            log.info("control: no fixed point in the grey part's first %d latents; encoding the rest live",
                     MEMO_LIMIT)
            self._limit_state = self._state.copy()
        elif i == MEMO_LIMIT:  # a later stream passes the limit: on from the history kept there
            self._state = self._limit_state.copy()
        return self._step(like, check=False)

    def stats(self) -> dict[str, int | None]:
        return {"kept": len(self.kept), "steady_from": self.steady_from, "encodes": self.encodes}

    def _step(self, like: torch.Tensor, check: bool) -> torch.Tensor:
        cache = self._state.encoder
        frames = TIME_STRIDE if cache.started else 1
        zeros = like.new_zeros((like.shape[0], like.shape[1], frames, *like.shape[3:]))
        before = {k: v.clone() for k, v in cache.buffers.items()} if check else None
        z = self.encoder.encode_stream(zeros.contiguous(memory_format=self.layout), self._state)
        self.encodes += 1
        if before is not None and before.keys() == cache.buffers.keys() and all(
                torch.equal(v, before[k]) for k, v in cache.buffers.items()):
            self.steady_from = len(self.kept)
            self._state = self.encoder.new_stream_state()  # its history is not needed any more
        return z
