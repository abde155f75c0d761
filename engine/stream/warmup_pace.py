"""A warm-up that leaves most of the GPU to a show running beside it.

Why: a hot standby is launched again after every takeover, while the engine that took over serves
the show on the same GPU. Its warm-up (synthetic streams through every plan, compiling and
capturing graphs) then takes the GPU for tens of seconds, and the show's frame rate falls with it.
Given a share below 1, the warm-up rests after each chunk of work, long enough that its own share
of the wall time is that share: the standby is ready later, and the show keeps its frames. The
chunk's GPU work is waited for first, so what is rested against is the work, not its launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class WarmupPace:
    """Call `chunk_done()` after each warm-up chunk; with `share` 1 it does nothing."""

    def __init__(self, share: float = 1.0, device: torch.device | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if not 0.0 < share <= 1.0:
            raise ValueError(f"warm-up share: {share}; allowed above 0 up to 1 (1: the warm-up takes the GPU "
                             f"whole)")
        self.share, self.device = share, device
        self._clock, self._sleep = clock, sleep
        self.rested_s = 0.0
        self._since = clock()

    def chunk_done(self) -> None:
        """Rest after a chunk: its time since the last rest, times (1 / share - 1)."""
        if self.share >= 1.0:
            return
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        worked = self._clock() - self._since
        rest = worked * (1.0 / self.share - 1.0)
        self._sleep(rest)
        self.rested_s += rest
        self._since = self._clock()
