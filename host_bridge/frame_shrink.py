"""Frames over the bridge's size limit, shrunk on a thread of their own rather than the host's.

A host's frame loop calls `submit()` every frame and must get it back within milliseconds whatever the
frame. Shrinking an 8K frame reads hundreds of megabytes however it is done, so `Bridge.submit` only
looks at its shape and hands such a frame here. One thread shrinks the newest one; a newer frame
replaces one still waiting (latest wins, like the bridge's pending frame, and counted the same way).
The shrunk frame goes back to the bridge as if it had just been submitted, unless a newer frame came
meanwhile. Checks that read every value (NaN, infinity) run here too, on the shrunk frame, which keeps
them (an area mean of a NaN is NaN): such a frame is refused and counted without raising in `submit()`.

The frame is read after `submit()` returned, so a host must not write into an array it submitted;
the hosts hand over a new array per frame (TouchDesigner's `numpyArray()`, decoded video).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from loom_live.host_bridge.wire import pixels as formats

log = logging.getLogger(__name__)

Deliver = Callable[[np.ndarray, str, int, float], None]  # (shrunk frame, layout, seq, submit time)


class FrameShrinker:
    def __init__(self, max_side: int, deliver: Deliver, refuse: Callable[[str], None]) -> None:
        self._max_side = max_side
        self._deliver = deliver
        self._refuse = refuse
        self._cond = threading.Condition()
        self._job: tuple[np.ndarray, str, int, float] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def offer(self, frame: np.ndarray, layout: str, seq: int, t: float) -> bool:
        """Queue `frame` (any thread; never waits for a shrink). True when it replaced one still waiting."""
        with self._cond:
            replaced = self._job is not None
            self._job = (frame, layout, seq, t)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="loom-frame-shrink", daemon=True)
                self._thread.start()
            self._cond.notify()
            return replaced

    def close(self) -> None:
        with self._cond:
            self._closed, self._job = True, None
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                (frame, layout, seq, t), self._job = self._job, None
            try:
                small = formats.check_frame(formats.limit_size(frame, self._max_side))
            except (TypeError, ValueError) as exc:
                self._refuse(str(exc))
                continue
            del frame  # the host's big array: not kept while the bridge takes the small one
            try:
                self._deliver(small, layout, seq, t)
            except Exception as exc:  # the bridge reports what it can; this thread must live on
                log.warning("a shrunk frame could not be handed over: %s: %s", type(exc).__name__, exc)
