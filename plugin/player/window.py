"""The player's preview window (OpenCV HighGUI), with a status overlay and keyboard input.

Only created when a window output is asked for and a display exists: the player must run on
headless machines (servers, CI, a render node feeding a stream), where OpenCV cannot open one.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import numpy as np

WINDOW_TITLE = "Loom"
KEY_POLL_MS = 1
OVERLAY_FONT_SCALE = 0.5
OVERLAY_LINE_PX = 18
X11_SOCKET_DIR = "/tmp/.X11-unix"
X11_TCP_BASE_PORT = 6000
X11_PROBE_TIMEOUT_S = 0.5


def display_available() -> bool:
    """Whether a window can be shown: always on Windows and macOS; on Linux, a reachable X11 or Wayland server.

    Probed before OpenCV is asked: its Qt backend aborts the whole process (no exception) when
    DISPLAY names a server that is not there, e.g. over SSH without X forwarding.
    """
    if sys.platform in ("win32", "darwin"):
        return True
    wayland = os.environ.get("WAYLAND_DISPLAY")
    if wayland and (Path(os.environ.get("XDG_RUNTIME_DIR", "/run/user")) / wayland).exists():
        return True
    return _x11_reachable(os.environ.get("DISPLAY", ""))


def _x11_reachable(display: str) -> bool:
    host, _, rest = display.partition(":")
    number = rest.split(".")[0]
    if not number.isdigit():
        return False
    if host in ("", "unix"):
        return Path(f"{X11_SOCKET_DIR}/X{number}").exists()
    try:
        with socket.create_connection((host, X11_TCP_BASE_PORT + int(number)), timeout=X11_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


class WindowUnavailable(RuntimeError):
    """No display, or an OpenCV build without GUI support."""


class PreviewWindow:
    """Shows RGB frames; `show()` returns the key code pressed (-1 for none)."""

    def __init__(self, title: str = WINDOW_TITLE) -> None:
        if not display_available():
            raise WindowUnavailable("no display to open a window on (DISPLAY/WAYLAND_DISPLAY unset or unreachable)")
        import cv2

        self._cv2 = cv2
        self.title = title
        self._fullscreen = False
        try:
            cv2.namedWindow(title, cv2.WINDOW_NORMAL)
        except cv2.error as exc:
            raise WindowUnavailable(f"OpenCV cannot open a window here ({exc.err or exc})") from exc

    def show(self, frame_rgb: np.ndarray, lines: list[str], fullscreen: bool) -> int:
        cv2 = self._cv2
        if fullscreen != self._fullscreen:
            cv2.setWindowProperty(self.title, cv2.WND_PROP_FULLSCREEN,
                                  cv2.WINDOW_FULLSCREEN if fullscreen else cv2.WINDOW_NORMAL)
            self._fullscreen = fullscreen
        bgr = cv2.cvtColor(frame_rgb, cv2.COLOR_RGB2BGR)
        for i, text in enumerate(lines):
            y = OVERLAY_LINE_PX * (i + 1)
            cv2.putText(bgr, text, (8, y), cv2.FONT_HERSHEY_SIMPLEX, OVERLAY_FONT_SCALE, (0, 0, 0), 3, cv2.LINE_AA)
            cv2.putText(bgr, text, (8, y), cv2.FONT_HERSHEY_SIMPLEX, OVERLAY_FONT_SCALE, (255, 255, 255), 1,
                        cv2.LINE_AA)
        cv2.imshow(self.title, bgr)
        return self.poll_key()

    def poll_key(self) -> int:
        """The key code pressed (-1 for none), the window's events handled meanwhile. OpenCV's thread only: also
        between frames, while a write waits on a stream that takes nothing (Player._poll_window)."""
        return self._cv2.waitKey(KEY_POLL_MS)

    def closed_by_user(self) -> bool:
        """The window's close button was clicked."""
        try:
            return self._cv2.getWindowProperty(self.title, self._cv2.WND_PROP_VISIBLE) < 1
        except self._cv2.error:
            return True

    def close(self) -> None:
        try:
            self._cv2.destroyWindow(self.title)
            self._cv2.waitKey(1)
        except self._cv2.error:
            pass
