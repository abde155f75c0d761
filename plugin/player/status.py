"""The player's terminal feedback: start-up stages, a progress bar for files, a status line for live inputs.

Quiet (`-q`) hides all of that and the notes said meanwhile; the run's last line (and a note on it: an input cut
short) and errors are still printed.

Start-up stages are printed once each, as they begin, and each is closed with how long it took; a
stage that lasts (the engine loading a model) gets a line every few seconds meanwhile, so a silent
terminal never looks like a hang; so does the wait for a file's first restyled frame. A file's progress
is tqdm's bar, started at the first restyled frame (so its rate and ETA measure the stream, not the
engine's start-up) and closed at N/N. On a terminal the bar and the live line are redrawn in place;
when stderr is a pipe or a log file, a full line (tqdm's own format) is printed every few seconds, so
logs stay readable.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

LOG_INTERVAL_S = 2.0
STAGE_HEARTBEAT_S = 5.0  # a stage still under way says so this often
TTY_INTERVAL_S = 0.1


def live_line(frames_out: int, status: Any, style: str = "") -> str:
    """`live  312 frames  11.8 fps  latency 340 ms  dropped 3  engine running` from a BridgeStatus, and the
    style the prompt landed on (`style ink wash 0.81`) when the model has a style table."""
    state = getattr(status, "state", "?")
    fps = getattr(status, "fps", 0.0) or 0.0
    latency = getattr(status, "latency_ms", 0.0) or 0.0
    dropped = getattr(status, "dropped", 0) or 0
    line = (f"live {frames_out:>6} frames  {fps:5.1f} fps  latency {latency:5.0f} ms  dropped {dropped}  "
            f"engine {state}")
    if style:
        line = f"{line}  {style}"
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
        self._stage = ""
        self._stage_started = self._stage_said = 0.0
        self._bar: tqdm | None = None
        self._bar_started = 0.0
        self._done = 0
        self._total: int | None = None
        self._postfix = ""
        self._logged: tuple[int, int | None] | None = None  # (done, total) of the last progress line logged
        self._waiting: tuple[threading.Event, threading.Thread] | None = None  # await_first's heartbeat
        self._say_lock = threading.Lock()  # the heartbeat's thread and the frame loop say lines both

    def update(self, line: str, force: bool = False) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if not force and now - self._last < (TTY_INTERVAL_S if self.tty else LOG_INTERVAL_S):
            return
        self._last = now
        if self.tty:
            self._write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self._write(line + "\n")
        self._shown = line

    def stage(self, text: str) -> None:
        """A start-up stage: printed when it begins (closing the one before with its duration); reported
        again while it lasts, a heartbeat line every STAGE_HEARTBEAT_S."""
        now = time.monotonic()
        if text == self._stage:
            if now - self._stage_said >= STAGE_HEARTBEAT_S:
                self._stage_said = now
                self.say(f"{text} ... {now - self._stage_started:.0f} s so far")
            return
        self.end_stage()
        self._stage, self._stage_started, self._stage_said = text, now, now
        self.say(f"{text} ...")

    def end_stage(self) -> None:
        """The stage under way (if any) is over: say how long it took."""
        if self._stage:
            self.say(f"{self._stage}: {time.monotonic() - self._stage_started:.1f} s")
            self._stage = ""

    def await_first(self, text: str) -> None:
        """Say `text` now and every STAGE_HEARTBEAT_S until the first progress: a file's first restyled
        frame can take minutes after the engine is ready (compiling at a new size), and nothing else
        speaks meanwhile, since the caller waits for that frame. A thread of its own says it; the first
        progress (or the bar's end) stops it before writing."""
        if self.quiet:
            return
        self.say(f"{text} ...")
        stop, started = threading.Event(), time.monotonic()

        def beat() -> None:
            while not stop.wait(STAGE_HEARTBEAT_S):
                self.say(f"{text} ... {time.monotonic() - started:.0f} s so far")

        thread = threading.Thread(target=beat, name="loom-status-heartbeat", daemon=True)
        thread.start()
        self._waiting = (stop, thread)

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            stop, thread = self._waiting
            stop.set()
            thread.join()
            self._waiting = None

    def progress(self, done: int, total: int | None) -> None:
        """Frames done out of `total` (None: unknown); the first call starts the clock."""
        if self.quiet:
            return
        self._stop_waiting()
        if self._bar is None:
            self._bar = tqdm(total=total, unit="frame", file=self.stream, dynamic_ncols=True, leave=True,
                             disable=not self.tty, mininterval=TTY_INTERVAL_S, desc="loom play",
                             postfix=self._postfix or None)
            self._bar_started = self._last = time.monotonic()  # a log's first line comes with a real rate
        self._bar.update(done - self._done)
        self._done, self._total = done, total
        if not self.tty:
            now = time.monotonic()
            if now - self._last >= LOG_INTERVAL_S or done == total:
                self._last = now
                self._log_progress()

    def _log_progress(self) -> None:
        line = tqdm.format_meter(self._done, self._total, time.monotonic() - self._bar_started, unit="frame",
                                 prefix="loom play", ncols=100, postfix=self._postfix or None)
        if line != self._shown:
            self._write(line + "\n")
            self._shown = line
        self._logged = (self._done, self._total)

    def set_postfix(self, text: str) -> None:
        """A short note shown after the progress bar's rate (the prompt's style), from now on."""
        self._postfix = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def end_progress(self, final_total: int | None = None) -> None:
        """Close the bar where it stands; `final_total`: the run is complete, so the bar ends at N/N
        even when the input's announced length was an estimate. A log gets that last line too."""
        self._stop_waiting()
        if self._bar is None:
            return
        if final_total is not None:
            self._bar.total = self._total = final_total
            self._bar.refresh()
        if not self.tty and self._logged != (self._done, self._total):  # not the same N/N twice
            self._log_progress()
        self._bar.close()
        self._bar = None

    def say(self, text: str) -> None:
        """A message on its own line (the status line or bar is redrawn after it)."""
        if self.quiet:
            return
        with self._say_lock:
            if self._bar is not None and self.tty:
                self._write(text, self._bar.write)
                return
            if self.tty and self._width:
                self._write("\r" + " " * self._width + "\r")
                self._width = 0
            self._write(text + "\n")

    def finish(self, line: str) -> None:
        """The run's last line (frames, where they went, how long), or a note on that result (an input cut
        short), printed in full even when quiet: `-q` hides what goes by, not the result a script that runs
        the player logs."""
        self.end_progress()
        if self.tty:
            self._write("\r" + line.ljust(self._width) + "\n")
        elif line != self._shown:
            self._write(line + "\n")
        self._width = 0

    def _write(self, text: str, write: Callable[..., Any] | None = None) -> None:
        """Write `text` and flush (`write`: tqdm's, above its bar). A stream that went away (the reader of
        `| tee show.log`, stopped by the same Ctrl-C; a closed terminal or SSH session) silences the
        printer: the run must still finalise its outputs and end with its own exit code."""
        try:
            if write is not None:
                write(text, file=self.stream)
            else:
                self.stream.write(text)
            self.stream.flush()
        except OSError:
            self.quiet = True
