"""Where a camera frame's time goes on the host, stage by stage, for the page and the latency benchmark.

The page measures glass to glass in its own clock; the host cannot share that clock, but it can
time its own stages with one: the camera frame decoded to submitted to the engine, submitted to its
restyled frame posted for sending (the engine's latency plus the wait to pick the output up), and
posted to handed to the WebRTC encoder. Each is a rolling median over the last few dozen frames.
"""

from __future__ import annotations

import threading
from collections import deque

KEEP = 60  # samples per stage: a few seconds of frames


class PathTimes:
    """Rolling medians of named stages, fed from any thread."""

    def __init__(self, keep: int = KEEP) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._samples: dict[str, deque[float]] = {}

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._samples.setdefault(stage, deque(maxlen=self._keep)).append(seconds)

    def medians_ms(self) -> dict[str, float]:
        """Each stage's median in milliseconds (stages with no sample yet are absent)."""
        with self._lock:
            copies = {stage: sorted(values) for stage, values in self._samples.items() if values}
        return {stage: round(1000 * values[len(values) // 2], 1) for stage, values in copies.items()}
