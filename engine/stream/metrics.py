"""What a performer needs to see about a running stream, kept in constant memory.

Per-frame latency is measured from the moment a frame is pushed to the moment its restyled
frame is returned, pairing inputs and outputs in order (the pipeline is one-in, one-out).
Percentiles and jitter are over a sliding window so an endless stream never grows memory.
Output frames leave in bursts (one chunk at a time), so output-interval jitter is measured
between deliveries, not between frames of one delivery.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

WINDOW = 1000  # frames kept for percentiles and jitter
FPS_WINDOW_S = 2.0  # seconds over which the output rate is measured


class StreamMetrics:
    def __init__(self, latency_budget_s: float = 1.0, clock=time.perf_counter) -> None:
        self.budget = latency_budget_s
        self.clock = clock
        self.reset()

    def set_budget(self, latency_budget_s: float) -> None:
        """The latency above which a frame counts as a miss, from the next frame on."""
        self.budget = latency_budget_s

    def reset(self) -> None:
        """A new stream: nothing in flight (the session dropped it), every figure afresh."""
        self._pushed: deque[float] = deque()
        self.restart()

    def restart(self) -> None:
        """Every figure afresh in the middle of a stream (after a warm-up, say). Frames pushed and not yet
        out keep their push times: a stream-batch pipeline or a ring of GPUs still holds them, and their
        outputs must pair with them, not with the frames pushed after (that would read a chunk period or
        more of latency as none, for the rest of the stream)."""
        self.frames_in = self.frames_out = self.dropped = self.misses = 0
        self.dropped_reasons: dict[str, int] = {}
        self._latency: deque[float] = deque(maxlen=WINDOW)
        self._deliveries: deque[tuple[float, int]] = deque(maxlen=WINDOW)
        self._first_push: float | None = None
        self.ttff_s: float | None = None
        self._stages: dict[str, list[float]] = {}

    def on_input(self, count: int, t: float | None = None) -> None:
        t = self.clock() if t is None else t
        if self._first_push is None:
            self._first_push = t
        self.frames_in += count
        self._pushed.extend([t] * count)

    def on_drop(self, count: int, reason: str) -> None:
        self.dropped += count
        self.dropped_reasons[reason] = self.dropped_reasons.get(reason, 0) + count

    def on_output(self, count: int, t: float | None = None) -> None:
        if count <= 0:
            return
        t = self.clock() if t is None else t
        if self.ttff_s is None and self._first_push is not None:
            self.ttff_s = t - self._first_push
        for _ in range(min(count, len(self._pushed))):
            lat = t - self._pushed.popleft()
            self._latency.append(lat)
            self.misses += lat > self.budget
        self.frames_out += count
        self._deliveries.append((t, count))

    def stage(self, name: str, seconds: float) -> None:
        """Record one stage's time (count, total, last, max)."""
        rec = self._stages.setdefault(name, [0, 0.0, 0.0, 0.0])
        rec[0] += 1
        rec[1] += seconds
        rec[2] = seconds
        rec[3] = max(rec[3], seconds)

    def fps(self) -> float:
        if len(self._deliveries) < 2:
            return 0.0
        now = self._deliveries[-1][0]
        recent = [(t, n) for t, n in self._deliveries if now - t <= FPS_WINDOW_S]
        if len(recent) < 2 or recent[-1][0] == recent[0][0]:
            return 0.0
        return sum(n for _, n in recent[1:]) / (recent[-1][0] - recent[0][0])

    def snapshot(self) -> dict:
        lat = np.asarray(self._latency, dtype=np.float64) * 1000.0
        times = np.asarray([t for t, _ in self._deliveries], dtype=np.float64)
        intervals = np.diff(times) * 1000.0
        pct = {f"p{q}": float(np.percentile(lat, q)) for q in (50, 90, 95, 99)} if lat.size else {}
        return {
            "frames_in": self.frames_in,
            "frames_out": self.frames_out,
            "dropped": self.dropped,
            "dropped_reasons": dict(self.dropped_reasons),
            "fps": round(self.fps(), 3),
            "ttff_s": self.ttff_s,
            "latency_ms": {"mean": float(lat.mean()) if lat.size else None, **pct,
                           "max": float(lat.max()) if lat.size else None},
            "latency_jitter_ms": float(lat.std()) if lat.size > 1 else None,
            "interval_jitter_ms": float(intervals.std()) if intervals.size > 1 else None,
            "slo_budget_ms": self.budget * 1000.0,
            "slo_miss_rate": self.misses / self.frames_out if self.frames_out else 0.0,
            "stages_ms": {k: {"mean": 1000.0 * v[1] / v[0], "last": 1000.0 * v[2], "max": 1000.0 * v[3],
                              "count": v[0]}
                          for k, v in self._stages.items()},
        }
