"""Per-stage timing that never stalls the stream.

On a GPU, stages are timed with CUDA events recorded on the stream that runs them and read back
only once they have completed, so measuring adds no host synchronisation to the frame loop. On a
CPU the work is synchronous and a wall clock suffices.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

MAX_PENDING = 256  # spans waiting for their events; older ones are dropped unread


class StageTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._pending: deque[tuple[str, object, object, object]] = deque(maxlen=MAX_PENDING)
        self._done: list[tuple[str, object, float]] = []

    @contextmanager
    def span(self, name: str, units: object = 1.0) -> Iterator[None]:
        """Time the block; `units` travels with the result (the caller's measure of work)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, units, start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._done.append((name, units, time.perf_counter() - t0))

    def collect(self) -> list[tuple[str, object, float]]:
        """Finished spans as (stage, units, seconds), each returned once."""
        while self._pending and self._pending[0][3].query():
            name, units, start, end = self._pending.popleft()
            self._done.append((name, units, start.elapsed_time(end) / 1000.0))
        done, self._done = self._done, []
        return done


def median_cuda_ms(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Benchmarks: the median GPU time of `fn` in ms, CUDA events around each call, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = sorted(timed_ms(fn, torch.device("cuda")) for _ in range(iters))
    return times[len(times) // 2]


def timed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Benchmarks: one call of `fn` in ms, by CUDA events on a GPU (its queued work included), else
    by the wall clock."""
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1000.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)
