"""The player's terminal feedback: a progress bar for files, a status line for live inputs.

On a terminal the line is redrawn in place; when stderr is a pipe or a log file, a full line
is printed every few seconds instead, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

BAR_WIDTH = 24
LOG_INTERVAL_S = 2.0
TTY_INTERVAL_S = 0.1


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


def progress_line(done: int, total: int, elapsed_s: float) -> str:
    """`[#####-------]  12/49 frames  3.1 fps  eta 0:12` for a file of known length."""
    total = max(total, 1)
    filled = min(BAR_WIDTH, BAR_WIDTH * done // total)
    fps = done / elapsed_s if elapsed_s > 0 else 0.0
    eta = (total - done) / fps if fps > 0 else 0.0
    return (f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {done:>5}/{total} frames  {fps:5.1f} fps  "
            f"eta {_clock(eta)}")


def live_line(frames_out: int, status: Any, stats: dict[str, Any] | None = None) -> str:
    """`live  312 frames  11.8 fps  latency 340 ms  dropped 3  engine running` from a BridgeStatus."""
    state = getattr(status, "state", "?")
    fps = getattr(status, "fps", 0.0) or 0.0
    latency = getattr(status, "latency_ms", 0.0) or 0.0
    dropped = getattr(status, "dropped", 0) or 0
    line = (f"live {frames_out:>6} frames  {fps:5.1f} fps  latency {latency:5.0f} ms  dropped {dropped}  "
            f"engine {state}")
    message = getattr(status, "message", "")
    return f"{line}  ({message})" if message and state != "running" else line


class StatusPrinter:
    """Redraws one status line on a terminal, or logs one line every LOG_INTERVAL_S otherwise."""

    def __init__(self, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = 0.0
        self._width = 0
        self._shown = ""

    def update(self, line: str, force: bool = False) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if not force and now - self._last < (TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S):
            return
        self._last = now
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self._shown = line
        self.stream.flush()

    def say(self, text: str) -> None:
        """A message on its own line (the status line is redrawn after it)."""
        if self.quiet:
            return
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self, line: str) -> None:
        """The final state of the line, always printed in full."""
        if self.quiet:
            return
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width) + "\n")
        elif line != self._shown:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._width = 0
