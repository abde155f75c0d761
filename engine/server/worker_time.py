"""Where the frame worker's time goes: reading input slots, inside the session's calls, and sending outputs.

Why: paced outputs leave only when the worker gets a chance to send them, between frames or during the
session's waits for the GPU (`FrameWorker._while_waiting`). Outputs that leave late together mean the worker
was held inside a session call; these totals say whether it was held waiting for the GPU (the waits, where it
sends) or running the call itself (launching work, where it cannot), so a bench can tell the two apart. The
totals only grow; a reader takes differences over the span it measures.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

PARTS = ("read", "session", "waiting", "emit", "write")


class WorkerTime:
    """Seconds per part, summed over the worker's life. `waiting` is the part of `session` between consecutive
    looks at the GPU within one call (its waits for the GPU, the looks' own sends included); parts nest, so
    `emit` counts sends made during those waits too, and `write` is the part of `emit` spent writing the frame into
    its output slot (on cuda-ipc: handing its conversion and copy to the GPU), the rest being the slot's bookkeeping
    and the notice."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)
        self._in_session = False
        self._last_look: float | None = None  # the latest look of the session call under way

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.spent[name] += time.perf_counter() - start

    @contextmanager
    def session(self) -> Iterator[None]:
        """A session call: timed as `session`, and the looks made inside it count as its waiting."""
        self._in_session, self._last_look = True, None
        try:
            with self.part("session"):
                yield
        finally:
            self._in_session = False

    def look(self) -> None:
        """A look at the GPU from inside a session call: the time since the call's previous look was a wait."""
        if not self._in_session:  # a flush's waits, say: not inside a timed call
            return
        now = time.perf_counter()
        if self._last_look is not None:
            self.spent["waiting"] += now - self._last_look
        self._last_look = now

    def report(self) -> dict[str, float]:
        """Milliseconds per part, summed so far."""
        return {name: round(seconds * 1000.0, 3) for name, seconds in self.spent.items()}
