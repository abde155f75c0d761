"""Non-finite frames out of a float16 VAE, counted without waiting for the GPU.

Why: float16 holds values up to 65504. A VAE whose activations outgrow that on some picture makes
inf, then NaN, and the NaN stays in the stream's history: every later frame of the stream is broken
until it resets. Asking the GPU about each chunk would stall the pipeline, so each decoded chunk adds
its verdict to a counter on the device, and a copy of the counter goes to pinned host memory behind
the chunk's work; the session reads whatever copy has landed, a chunk or two late: before each push
(`news`, to start a new stream that clears the NaN) and when it reports (`chunks`), and says once what
to change.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class NonFiniteWatch:
    """Counts decoded chunks that hold a NaN or an infinity over a session's life (a new stream does not
    mend the VAE); `check` on the stream that made them."""

    def __init__(self, device: torch.device, what: str) -> None:
        self.what = what
        self._count = torch.zeros((), dtype=torch.int32, device=device)
        self._host = torch.zeros((), dtype=torch.int32, pin_memory=device.type == "cuda")
        self._said = False
        self._seen = 0  # broken chunks already answered by `news`

    def check(self, x: torch.Tensor) -> None:
        """Queue the test of one chunk and the counter's copy home; never waits."""
        self._count += (~torch.isfinite(x)).any()
        self._host.copy_(self._count, non_blocking=True)

    def chunks(self) -> int:
        """Chunks found broken so far, as far as the copies home have come; logs the first time."""
        found = int(self._host)
        if found and not self._said:
            self._said = True
            logger.error("%s made non-finite frames (%d chunk(s) so far): its values outgrew float16, and the "
                         "stream starts afresh each time; set vae.dtype=bfloat16 (or auto) and restart the engine",
                         self.what, found)
        return found

    def news(self) -> int:
        """Chunks found broken since the last call; never waits."""
        found = self.chunks()
        new, self._seen = found - self._seen, found
        return new


def watch_for(models: Any, device: torch.device) -> NonFiniteWatch | None:
    """A watch on the decoded frames where the Wan VAE encodes or decodes in float16 (`vae.dtype`: an overflow
    in the encoder reaches the frames through the latents); None where neither does."""
    if torch.float16 not in (models.encoder.dtype, models.decoder.dtype):
        return None
    return NonFiniteWatch(device, "the Wan VAE in float16 (vae.dtype)")
