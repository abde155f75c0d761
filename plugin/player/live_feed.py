"""A live input (camera, network stream) read on its own thread, reconnected when it stalls or drops.

On stage a feed that stops for a moment (a network hiccup, an RTSP server restarting, a camera
re-plugged) must not stop the show: reading on the player's thread blocked the window and every
output for the read timeout and then ended the run. Here the player asks for the newest frame
with a timeout and holds the last picture meanwhile, while this thread reopens the input until
it answers again or the run ends.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

# Pause between attempts to reopen a lost input (each attempt may itself wait for the open timeout).
RECONNECT_PAUSE_S = 1.0
# How long close() waits for the reading thread. A read or reopen in progress ends only by its own
# timeout (5-10 s); the outputs are finished by then, so quitting does not wait for it: the thread
# closes its source itself when the call returns.
CLOSE_WAIT_S = 1.0


class LiveFeed:
    """Newest frame of a live source; reopens it with ``reopen()`` after an error or an end.

    The source is used only from this object's thread (PyAV must not be closed under a read in
    progress); ``close()`` asks the thread to stop and waits for it.
    """

    def __init__(self, source: Any, reopen: Callable[[], Any]) -> None:
        self._source = source
        self._reopen = reopen
        self._cond = threading.Condition()
        self._frame: np.ndarray | None = None
        self._stop = threading.Event()
        self._messages: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="loom-live-input", daemon=True)
        self._thread.start()

    def next(self, timeout_s: float) -> np.ndarray | None:
        """The newest frame not handed out yet, or None if none came within ``timeout_s``."""
        with self._cond:
            if self._frame is None:
                self._cond.wait(timeout_s)
            frame, self._frame = self._frame, None
        return frame

    def messages(self) -> list[str]:
        """What happened to the input since the last call (lost, reconnected), for the user."""
        out = []
        while not self._messages.empty():
            out.append(self._messages.get_nowait())
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(CLOSE_WAIT_S)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    frame = self._source.read()
                    why = "the stream ended"
                except Exception as exc:  # whatever breaks the input, the show goes on: reconnect
                    frame, why = None, str(exc)
                if frame is not None:
                    with self._cond:
                        self._frame = frame
                        self._cond.notify()
                    continue
                self._messages.put(f"input lost ({why}); reconnecting, the last picture is held")
                _close_quietly(self._source)
                self._source = self._reconnect()
        finally:
            _close_quietly(self._source)

    def _reconnect(self) -> Any:
        """A new source at once, then every RECONNECT_PAUSE_S; None when the run ends first."""
        while not self._stop.is_set():
            try:
                source = self._reopen()
            except Exception:  # still gone (MediaError) or worse: try again after the pause
                self._stop.wait(RECONNECT_PAUSE_S)
                continue
            self._messages.put(f"input reconnected: {source.name}")
            return source
        return None


def _close_quietly(source: Any) -> None:
    """Close a source that may already be broken: a failing close must not end the reading thread."""
    if source is not None:
        with contextlib.suppress(Exception):
            source.close()
