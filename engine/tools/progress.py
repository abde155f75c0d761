"""Frame progress for the long-running tools (bench, eval): tqdm's bar on a terminal, and on a pipe or
log file one plain line (tqdm's format) every few seconds, so a log reads line by line without
carriage returns. The clock starts at the first frame counted, not at model loading."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

LOG_INTERVAL_S = 5.0


class FrameProgress:
    """`update(n)` after each batch of frames; `close()` prints the last state (N/N after a whole run)."""

    def __init__(self, total: int | None, desc: str, stream: TextIO | None = None, quiet: bool = False) -> None:
        self.stream = stream or sys.stderr
        self.desc = desc
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.quiet = quiet
        self.total = total
        self.done = 0
        self._bar: tqdm | None = None
        self._started = self._last = 0.0

    def update(self, frames: int) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if self.done == 0 and self._bar is None:
            self._started = self._last = now
            self._bar = tqdm(total=self.total, unit="frame", desc=self.desc, file=self.stream,
                             dynamic_ncols=True, disable=not self.tty, mininterval=0.2)
        self.done += frames
        self._bar.update(frames)
        if not self.tty and now - self._last >= LOG_INTERVAL_S:
            self._last = now
            self._line()

    def _line(self) -> None:
        self.stream.write(tqdm.format_meter(self.done, self.total, time.monotonic() - self._started,
                                            unit="frame", prefix=self.desc, ncols=100) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._bar is None:
            return
        if not self.tty:
            self._line()
        self._bar.close()
        self._bar = None
