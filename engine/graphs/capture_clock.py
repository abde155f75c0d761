"""How many CUDA graph captures this process made, and how long they took.

Why: an engine's start-up is model build, weight load, compilation, graph capture and warm-up
streams, and only the last is real work; the start-up breakdown (`engine.stream.startup`) reads
this clock to tell capture time apart. Every capture site (DiT steps, VAE steps, the LoRA merge)
runs its capture inside `CAPTURES.timed()`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class CaptureClock:
    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0

    @contextmanager
    def timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.count += 1
            self.seconds += time.perf_counter() - t0


CAPTURES = CaptureClock()  # process-wide: captures happen on the threads that build and run sessions
