"""Hands TouchDesigner's input frames to the bridge from a thread of its own (shm and tcp transports).

`numpyArray()` gives a float32 RGBA frame; turning 1920x1080 of it into the engine's uint8 RGB
takes longer than a 60 FPS frame on a small CPU. Done in the cook it would stall TouchDesigner's
main thread; here the cook only leaves the array in a one-frame mailbox (numpy releases the GIL
while it converts, so the main thread runs on). A newer frame replaces one not yet taken: the
stream stays live, as `Bridge.submit` itself does. No CUDA work happens here.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger(__name__)


class HostFeeder:
    """One daemon thread per bridge: the newest offered frame goes to `bridge.submit(..., layout)`."""

    def __init__(self, bridge: Any, layout: str = "touchdesigner") -> None:
        self._bridge, self._layout = bridge, layout
        self._cond = threading.Condition()
        self._frame: Any = None
        self._control: Any = None  # the frame's control frame (the component's second input), if wired
        self._closed = False
        self.replaced = 0  # frames replaced before the thread took them
        self.error = ""  # the last frame the bridge refused, and why (shown on the component)
        self._thread = threading.Thread(target=self._run, name="loom-td-feeder", daemon=True)
        self._thread.start()

    def offer(self, frame: Any, control: Any = None) -> None:
        """Leave `frame` (and its control frame, VACE) for the thread; returns at once."""
        with self._cond:
            if self._frame is not None:
                self.replaced += 1
            self._frame, self._control = frame, control
            self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread after the frame it is converting (if any)."""
        with self._cond:
            self._closed = True
            self._frame = None
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._frame is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                frame, self._frame = self._frame, None
                control, self._control = self._control, None
            try:
                self._bridge.submit(frame, layout=self._layout, control=control)
                self.error = ""
            except Exception as exc:  # a bad frame must not end the thread: the next one may be fine
                self.error = f"input frame not taken: {exc}"
                log.debug("input frame refused: %s", exc)
