"""Video between the page and the host over WebRTC (aiortc): the boards frames are posted on, the
track that sends a board's newest frame, and the reader of the page's camera track.

The player's thread posts frames; each peer's sending track, on the server's event loop, sends the
newest one whenever a new one is posted. A slow peer (its encoder, its network) only ever skips to
the newest frame: no peer builds a queue, and none holds back the player or another peer. The
page's camera is read the same way: decoded frames the host has not taken yet are skipped for the
newest, so a busy moment never leaves the engine working through stale frames.
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

from loom_live.plugin.web.path_times import PathTimes

log = logging.getLogger(__name__)
CLOCK = 90000  # the RTP video clock
TIME_BASE = fractions.Fraction(1, CLOCK)


class FrameBoard:
    """The newest frame of one kind (the restyled output, the input preview); posted from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._frame: np.ndarray | None = None
        self._posted = 0.0
        self.version = 0
        self.skipped = 0  # frames posted that no track sent: a newer one came first
        self._event = asyncio.Event()

    def post(self, frame: np.ndarray) -> None:
        """Make `frame` (uint8 RGB, not changed afterwards by the caller) the newest; wakes the tracks."""
        with self._lock:
            self._frame = frame
            self._posted = time.monotonic()
            self.version += 1
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop has closed: the server is stopping
            pass

    def _wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def newer(self, version: int) -> tuple[np.ndarray, int, float]:
        """The newest frame once its version is past `version`, its version and when it was posted
        (time.monotonic()); waits on the server's loop."""
        while True:
            with self._lock:
                frame, current, posted = self._frame, self.version, self._posted
            if frame is not None and current > version:
                return frame, current, posted
            await self._event.wait()


class BoardTrack(MediaStreamTrack):
    """A video track that sends its board's newest frame each time one is posted."""

    kind = "video"

    def __init__(self, board: FrameBoard, times: PathTimes | None = None) -> None:
        super().__init__()
        self._board = board
        self._times = times
        self._version = 0
        self._t0 = time.monotonic()

    async def recv(self) -> VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        frame, self._version, posted = await self._board.newer(self._version)
        if self._times is not None:
            self._times.add("post_to_send", time.monotonic() - posted)
        out = VideoFrame.from_ndarray(frame, format="rgb24")
        out.pts = int((time.monotonic() - self._t0) * CLOCK)
        out.time_base = TIME_BASE
        return out


async def read_camera(track: MediaStreamTrack, put: Callable[[np.ndarray], None]) -> int:
    """Hand the page's camera track's newest frame to `put` (uint8 RGB), again and again until the track
    ends; returns how many decoded frames were skipped for a newer one."""
    skipped = 0
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return skipped
        ended = False
        waiting = getattr(track, "_queue", None)  # aiortc's decoded frames not taken yet
        while isinstance(waiting, asyncio.Queue) and not waiting.empty():
            newer = waiting.get_nowait()
            if newer is None:  # the track's end: this frame is its last
                ended = True
                break
            frame, skipped = newer, skipped + 1
        put(frame.to_ndarray(format="rgb24"))
        if ended:
            track.stop()
            return skipped
