"""How a session being built says how its start-up goes, to whoever waits on it.

Why: a first start on a GPU compiles every step before its first frame, and a host waiting on it should see it move,
not one line the whole time. The server points `STARTUP_PROGRESS` at the host (`to`) while it builds the
session; a session's start-up record (engine/stream/startup.py) and the other families `say` each phase.
Outside `to`, saying is a no-op. A module of its own, importing nothing of the engine, so the server and
every session family can reach it without an import cycle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class StartupProgress:
    """The one sink start-up progress goes to: a host's status while the server builds a session, else none."""

    def __init__(self) -> None:
        self._report: Callable[[str], None] | None = None

    @contextmanager
    def to(self, report: Callable[[str], None]) -> Iterator[None]:
        """Send what sessions built inside this block say to `report`."""
        self._report = report
        try:
            yield
        finally:
            self._report = None

    def say(self, text: str) -> None:
        if self._report is None:
            return
        try:
            self._report(text)
        except Exception as exc:  # noqa: BLE001 (telemetry: never a reason for a start to fail)
            log.warning("start-up progress not sent: %s: %s", type(exc).__name__, exc)


STARTUP_PROGRESS = StartupProgress()
