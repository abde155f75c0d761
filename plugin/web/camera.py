"""The browser's camera as a player input: the newest frame the driving page sent over WebRTC.

It is a live `FrameSource` like a webcam, so the player's live loop, its stall handling and its
outputs work on it unchanged. The page sends its picture at the host's size with the stamp strip
(stamp.py) under it; this source crops the strip off, so the engine sees only the picture, and
remembers each recent frame's stamp (and when it came) for the web host to carry through the engine.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from loom_live.plugin.media.base import FrameSource
from loom_live.plugin.web import stamp

NAME = "the browser's camera"
RECENT = 64  # frames whose stamps are remembered: more than the player can hold between read and submit


class BrowserCamera(FrameSource):
    """Frames put by the WebRTC side (`put`, any thread), read by the player's live feed (`read` blocks)."""

    def __init__(self, size: tuple[int, int], fps: float) -> None:
        super().__init__(NAME, fps, size[0], size[1], None, is_live=True)
        self._cond = threading.Condition()
        self._frame: np.ndarray | None = None
        self._recent: deque[tuple[np.ndarray, int, float]] = deque(maxlen=RECENT)
        self.received = 0

    def put(self, picture: np.ndarray) -> None:
        """One frame as the page sent it: uint8 RGB, the picture with the stamp strip below it."""
        import cv2

        arrived = time.monotonic()
        w, h = self.size
        rows = h + stamp.STAMP_ROWS
        if picture.shape[:2] != (rows, w):  # the browser scaled the video on the way: back to the agreed size
            picture = cv2.resize(picture, (w, rows), interpolation=cv2.INTER_AREA)
        code = stamp.decode(picture[h:])
        frame = np.ascontiguousarray(picture[:h])
        with self._cond:
            self._recent.append((frame, code, arrived))
            self._frame = frame
            self.received += 1
            self._cond.notify_all()

    def origin_of(self, frame: np.ndarray) -> tuple[int, float | None]:
        """The stamp of a frame this camera gave out (or a view of one from its first pixel) and when it
        came (time.monotonic()); (0, None) if unknown."""
        address = frame.__array_interface__["data"][0]
        with self._cond:
            for recent, code, arrived in reversed(self._recent):
                if recent.__array_interface__["data"][0] == address:
                    return code, arrived
        return 0, None

    def _read(self) -> np.ndarray | None:
        """Waits for the next frame; None once the camera is closed (the run ends)."""
        with self._cond:
            while self._frame is None and not self.closed:
                self._cond.wait()
            frame, self._frame = self._frame, None
        return frame

    def _close(self) -> None:
        with self._cond:
            self._cond.notify_all()
