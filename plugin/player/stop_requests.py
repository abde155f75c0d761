"""Stop signals during a run (Ctrl-C, a process manager's SIGTERM, a closed terminal's SIGHUP), raised where it is
safe to raise them.

A handler that raises injects its exception between any two instructions of the main thread. The bridge takes and
drops its locks (the frame lane's, the doorbell's) at points where such an exception leaves one held, and the run's
own finishing then waits on it for ever: a stopped show that never ends, its recording never finalised. So a stop
that arrives while the main thread is inside the bridge is held: the bridge is asked to end the wait it is in
(`Bridge.interrupt`, which raises `Interrupted` from a place made to raise), and the player raises the stop itself at
its next frame (`StopSignals.check`). Anywhere else it is raised at once, as Python raises Ctrl-C.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from loom_live import host_bridge, plugin
from loom_live.plugin.media.stop_signals import DEFERRED_SIGNALS

_BRIDGE = host_bridge.__name__ + "."  # the bridge's modules, the wire layer among them
_PLUGIN = plugin.__name__ + "."  # the player's and its media's modules


class StopRequested(BaseException):
    """SIGTERM or SIGHUP arrived; a BaseException, like KeyboardInterrupt, so that no `except Exception`
    (an engine retry, say) mistakes it for a failure and carries on."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_exception(signum: int) -> BaseException:
    """What a stop signal raises: KeyboardInterrupt for Ctrl-C, as Python's own handler does; else StopRequested."""
    return KeyboardInterrupt() if signum == signal.SIGINT else StopRequested(signum)


class StopSignals:
    """The run's stop-signal handler and the stop it holds back; `install` at the start of a run (main thread only),
    restore what it returns at the end. `interrupt` ends the bridge's wait in progress (Bridge.interrupt)."""

    def __init__(self, interrupt: Callable[[], None]) -> None:
        self._interrupt = interrupt
        self.signum: int | None = None  # the first stop signal of the run: it stands until the run ends

    def install(self) -> dict[int, Any]:
        """Handle the stop signals (DEFERRED_SIGNALS: Ctrl-C, SIGTERM, SIGHUP) from now; returns the handlers
        replaced, to restore. By default SIGTERM and SIGHUP end Python on the spot and leave an MP4 without its index
        (unplayable); a signal the run was started ignoring (`nohup`, a background job's Ctrl-C) stays ignored. Off
        the main thread no handler can be set (and no signal arrives): nothing is done and nothing returned."""
        self.signum = None
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {signum: signal.signal(signum, self._handle) for signum in DEFERRED_SIGNALS
                if signal.getsignal(signum) != signal.SIG_IGN}

    def check(self) -> None:
        """Raise the run's stop: one held back while the main thread was in the bridge, or one raised that a
        library's `except` or a finaliser (whose exceptions Python only prints) swallowed."""
        if self.signum is not None:
            raise stop_exception(self.signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        if _inside_bridge(frame):
            self._interrupt()
            return
        raise stop_exception(signum)


def _inside_bridge(frame: FrameType | None) -> bool:
    """Whether the innermost of the bridge's and the player's frames running is the bridge's (a library the bridge
    called, threading's waits say, counts as the bridge; a player generator the bridge pulls from, as the player)."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith(_BRIDGE):
            return True
        if module.startswith(_PLUGIN):
            return False
        frame = frame.f_back
    return False


def stop_outcome(stop: BaseException, held: int | None) -> tuple[str, int]:
    """How a stop is said ("Ctrl-C", "SIGTERM") and the run's exit code, the shell's 128 + the signal (130, 143).
    `held`: the signal that a bridge's Interrupted stands for."""
    if isinstance(stop, StopRequested):
        signum = stop.signum
    elif isinstance(stop, KeyboardInterrupt) or held is None:
        signum = signal.SIGINT
    else:
        signum = held
    return ("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name), 128 + signum
