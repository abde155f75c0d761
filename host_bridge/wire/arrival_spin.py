"""Spin-then-block around the predicted arrival of the next paced frame notice.

Why: on a paced stream (a host at 60 FPS) the waiting side of a doorbell sleeps in the kernel
between frames, and each frame then waits for a wake-up sent by another process. Where such a
wake arrives late (a sandboxed kernel, a busy machine), the frame waits with it. A stream that is
paced says when its next notice is due, so the waiter can sleep with a timeout that ends a little
before that time and then poll the counter for a short window around it: the notice is seen
when it is published, without waiting for a wake. Outside the window, and whenever there is no
prediction (the first frames, a stream that stopped or became irregular), the waiter blocks as
before, so an idle link spins for at most one window after its last frame.

The prediction is the producer's last frame notice plus the median of the recent intervals
between its notices, both from the publish times the records carry (the producer's clock, which
is this machine's: a late reader does not shift them). Off unless a window is set
(`LOOM_DOORBELL_SPIN_US`, the window's half-width in microseconds); docs/performance.md has what
it buys.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections import deque

logger = logging.getLogger(__name__)

ENV = "LOOM_DOORBELL_SPIN_US"
MAX_WINDOW_S = 0.002  # a window wider than this is a mistake: it would spin a quarter of a 120 FPS period
INTERVALS = 8  # recent intervals the period is the median of
MIN_INTERVALS = 3  # before this many, no prediction
MAX_INTERVAL_S = 0.25  # a longer gap is a pause (below 4 FPS), not a period: the prediction starts again


class ArrivalSpin:
    """When to spin, for one reader: `arrived` for each frame notice, `plan` before each wait."""

    def __init__(self, window_s: float = 0.0) -> None:
        if not 0.0 <= window_s <= MAX_WINDOW_S:
            raise ValueError(f"arrival spin window: {window_s * 1e6:g} us; allowed 0 (off) to "
                             f"{MAX_WINDOW_S * 1e6:g} us")
        self.window_s = window_s
        self._last: float | None = None
        self._intervals: deque[float] = deque(maxlen=INTERVALS)

    @classmethod
    def from_env(cls) -> ArrivalSpin:
        """The window `LOOM_DOORBELL_SPIN_US` asks for (unset: off; a bad value: off, with one warning)."""
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return cls()
        try:
            return cls(float(raw) / 1e6)
        except ValueError as exc:
            logger.warning("%s=%r ignored (%s); the doorbell does not spin", ENV, raw, exc)
            return cls()

    @property
    def enabled(self) -> bool:
        return self.window_s > 0.0

    def arrived(self, published_s: float) -> None:
        """A frame notice the producer published at `published_s` (seconds of `time.time()`)."""
        if not self.enabled:
            return
        if self._last is not None:
            gap = published_s - self._last
            if 0.0 < gap <= MAX_INTERVAL_S:
                self._intervals.append(gap)
            elif gap > MAX_INTERVAL_S:
                self._intervals.clear()  # a pause: the next period is measured afresh
        self._last = published_s if self._last is None else max(self._last, published_s)

    def due(self) -> float | None:
        """When the next frame notice should be published (`time.time()` seconds); None: no prediction."""
        if not self.enabled or self._last is None or len(self._intervals) < MIN_INTERVALS:
            return None
        return self._last + statistics.median(self._intervals)

    def plan(self, now: float) -> float | None:
        """What a waiter does at `now` (`time.time()` seconds): 0.0, poll again at once (in the window);
        a positive number, block at most that long (the window opens then); None, block as usual."""
        due = self.due()
        if due is None:
            return None
        if now < due - self.window_s:
            return due - self.window_s - now
        if now <= due + self.window_s:
            return 0.0
        return None  # the window passed without the notice: wait for it (or the next arrival) blocked
