"""Video between the page and the host over WebRTC (aiortc): the boards frames are posted on, the
track that sends a board's newest frame, and the reader of the page's camera track.

The player's thread posts frames; each peer's sending track, on the server's event loop, sends the
newest one whenever a new one is posted. A slow peer (its encoder, its network) only ever skips to
the newest frame: no peer builds a queue, and none holds back the player or another peer.
"""

from __future__ import annotations

import asyncio
import fractions
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError
from av import VideoFrame

log = logging.getLogger(__name__)
CLOCK = 90000  # the RTP video clock
TIME_BASE = fractions.Fraction(1, CLOCK)


class FrameBoard:
    """The newest frame of one kind (the restyled output, the input preview); posted from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._frame: np.ndarray | None = None
        self.version = 0
        self._event = asyncio.Event()

    def post(self, frame: np.ndarray) -> None:
        """Make `frame` (uint8 RGB, not changed afterwards by the caller) the newest; wakes the tracks."""
        with self._lock:
            self._frame = frame
            self.version += 1
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop has closed: the server is stopping
            pass

    def _wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def newer(self, version: int) -> tuple[np.ndarray, int]:
        """The newest frame once its version is past `version` (waits on the server's loop)."""
        while True:
            with self._lock:
                frame, current = self._frame, self.version
            if frame is not None and current > version:
                return frame, current
            await self._event.wait()


class BoardTrack(MediaStreamTrack):
    """A video track that sends its board's newest frame each time one is posted."""

    kind = "video"

    def __init__(self, board: FrameBoard) -> None:
        super().__init__()
        self._board = board
        self._version = 0
        self._t0 = time.monotonic()

    async def recv(self) -> VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        frame, self._version = await self._board.newer(self._version)
        out = VideoFrame.from_ndarray(frame, format="rgb24")
        out.pts = int((time.monotonic() - self._t0) * CLOCK)
        out.time_base = TIME_BASE
        return out


async def read_camera(track: MediaStreamTrack, put: Callable[[np.ndarray], None]) -> None:
    """Hand every frame of the page's camera track to `put` (uint8 RGB) until the track ends."""
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        put(frame.to_ndarray(format="rgb24"))
