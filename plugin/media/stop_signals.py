"""Ctrl-C and stop signals held back while an output writes what must not be cut in half.

A signal raised between an encode and its mux loses the packets just encoded; one raised while a file's trailer
is written leaves a file that plays nothing. ``signals_deferred`` holds such a signal until the block is done,
stopping the open outputs meanwhile (``OPEN_SINKS``), then delivers it as it would have been.

This module imports no other of ``plugin.media``: the outputs register here, so it never imports them.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

# Signals that end a run, held back while encoded packets or a file's trailer are written (signals_deferred).
DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class OpenSink(Protocol):
    """An output open now (FrameSink): ``stop`` is safe from a signal handler, ``close`` finishes the output."""

    def stop(self) -> None: ...

    def close(self) -> None: ...


# The outputs open now: each adds itself at open and leaves at close. A signal held back stops them.
OPEN_SINKS: weakref.WeakSet[OpenSink] = weakref.WeakSet()


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and a stop signal (SIGTERM, SIGHUP) back while encoded packets are written or a file is
    finalised, then deliver the first one. Raised between an encode and its mux, it would lose the packets
    just encoded, the stream's first keyframe among them: a kept file that plays nothing. A signal held here that
    is not ignored stops the open outputs (FrameSink.stop), so that a write to a network output whose receiver
    takes nothing gives up at once. It is delivered even when the block raises (a write that failed): a Ctrl-C
    is then still a Ctrl-C, with the failure as its context, not lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous: dict[int, Any] = {}

    def hold(signum: int, _frame: Any) -> None:
        received.append(signum)
        if previous.get(signum) != signal.SIG_IGN:
            for sink in list(OPEN_SINKS):
                sink.stop()

    for signum in DEFERRED_SIGNALS:
        previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            _deliver(received[0], previous[received[0]])


def _deliver(signum: int, handler: Any) -> None:
    """Do with a signal held back what ``handler``, the one it would have met, does."""
    if handler is signal.default_int_handler:
        raise KeyboardInterrupt
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)
