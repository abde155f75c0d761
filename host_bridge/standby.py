"""A hot standby engine: a second launched engine, loaded (and warmed) while the active one serves.

Restarting a GPU engine means loading weights, compiling and capturing graphs again, which takes
far longer than a show can stand in fallback. With `BridgeConfig.standby`, the supervisor keeps one
more engine process ready: launched with the same settings, handshaked, loaded, and kept alive by
heartbeats, but given no rings and no frames. When the active engine dies or hangs, the supervisor
takes the standby (`take()`, which gives up one that is not alive itself) and uses it at once: it
gets the prompt, the parameters and the next frame like any fresh engine, and its rings on its first
frame. Then a new standby is started.

The standby's control messages are served here, on the supervisor's thread (`step()`); host threads
never see a standby link. Its own failures (exit, hang, no handshake, a refused run) only cost a new
standby after a backoff, never the show; the backoff doubles with each failure in a row (up to a
minute, or `restart_backoff_max_s` if longer), so a standby that cannot load (no room on the GPU, weights gone) does not
load the machine every few seconds during the show, and it starts again from the first delay once a
standby is ready.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from loom_live.host_bridge.config import BridgeConfig
from loom_live.host_bridge.link import Link
from loom_live.host_bridge.link_open import LinkOpenError, open_link

logger = logging.getLogger(__name__)

RETRY_S = 2.0  # after a standby failed to open or died, wait at least this long before the next one
# the longest wait between standbys that keep failing, unless restart_backoff_max_s is longer: a spare that
# cannot load is not worth a load on the machine every few seconds while the engine in use serves
RETRY_MAX_S = 60.0


class Standby:
    """At most one standby link; the supervisor thread calls every method."""

    def __init__(self, config: BridgeConfig, ctx: zmq.Context, lock: threading.RLock, link_ids: Iterator[int]):
        self.config = config
        self._ctx = ctx
        self._lock = lock
        self._link_ids = link_ids
        self.link: Link | None = None
        self.problem = ""  # why the last standby went away
        self.refusal = ""  # its own error when it refused its run (exit code 2) before it was ready
        self.last_lines: list[str] = []  # its last lines of output, each naming it and its pid
        self.started = 0  # standby engines launched so far
        self.failures = 0  # standbys in a row that failed before they were ready (the backoff doubles with each)
        self._next_open = 0.0

    @property
    def ready(self) -> bool:
        return self.link is not None and self.link.ready

    def describe(self) -> dict[str, Any]:
        """For the host's stats: state (none, starting, loading, ready), its pid, how many failed in a row and
        why the last one went."""
        state = "none" if self.link is None else \
            {"hello": "starting", "loading": "loading", "running": "ready"}[self.link.phase]
        return {"state": state, "pid": self.link.pid if self.link else None, "launched": self.started,
                "failures": self.failures, "last_problem": self.problem}

    def step(self, open_new: bool, beside_show: bool = False) -> None:
        """Open a standby when there is none (if `open_new` and the retry time has come; `beside_show`: an
        engine serves, so its warm-up takes only `standby_warmup_share` of the time), serve its control
        messages without waiting, send heartbeats, and give it up when it exits or hangs."""
        link = self.link
        if link is None:
            if open_new and time.monotonic() >= self._next_open:
                self._open(self.config.standby_warmup_share if beside_show else 1.0)
            return
        try:
            messages = link.channel.poll(0)
        except zmq.ZMQError as exc:
            self._drop(f"control socket error: {exc}")
            return
        for msg, _payload in messages:
            try:
                problem = self._handle(link, msg)
            except Exception as exc:  # an odd message is refused and counted, never fatal
                link.channel.refuse(f"{msg['type']} message: {type(exc).__name__}: {exc}")
                continue
            if problem:
                self._drop(problem)
                return
        problem = link.check(time.monotonic())
        if problem:
            self._drop(problem)
            return
        link.maybe_heartbeat(time.monotonic())

    def take(self) -> Link | None:
        """The ready standby link, handed over (a new standby is opened on a later `step`); else None.

        It is judged once more first, as `step` judges it: it may have exited or gone silent since the last
        `step` (an event that kills the engine in use often kills it too). Such a one is given up, not
        adopted, and the caller restarts the engine as it would without a standby."""
        link = self.link
        if link is None or not link.ready:
            return None
        problem = link.check(time.monotonic())
        if problem:
            self._drop(problem)
            return None
        self.link = None
        link.heard()  # it was heard until now; the new owner judges it from here
        return link

    def close(self) -> None:
        link, self.link = self.link, None
        if link is not None:
            link.teardown("closed", self.config.stop_timeout_s)

    def _open(self, warmup_share: float) -> None:
        try:
            self.link = open_link(self._ctx, self.config, self._link_ids, self._lock, warmup_share)
        except LinkOpenError as exc:
            self._failed(str(exc))
            return
        self.started += 1
        logger.debug("standby engine launched (pid %s)", self.link.pid)

    def _handle(self, link: Link, msg: dict[str, Any]) -> str | None:
        kind = msg["type"]
        link.heard()
        if kind == "hello":
            return link.on_hello(msg)
        if kind == "ready":
            if not link.hello_done:
                link.channel.refuse("ready before hello")
            else:
                link.on_ready(msg.get("info") or {})
                self.failures = 0
                logger.debug("standby engine ready (pid %s)", link.pid)
        elif kind == "status" and msg["state"] == "error":
            self.problem = f"standby engine error: {msg.get('message', '')}"
        elif kind == "bye":
            return f"standby engine said bye: {msg.get('reason', '')}"
        elif kind not in ("heartbeat", "status", "ack", "error", "stats"):
            link.channel.refuse(f"unexpected {kind} message from the standby engine")
        return None

    def _drop(self, reason: str) -> None:
        """Give the standby up; stopping its process happens on a thread of its own, so the supervisor
        goes on serving the active engine meanwhile. What it said is kept for a bridge that waited for it:
        its last lines, and (read as the supervisor reads the engine in use's) whether it refused its run."""
        link, self.link = self.link, None
        refusal, last_lines = "", []
        if link is not None:
            refusal, last_lines = "" if link.ready else link.refusal() or "", link.log_tail("standby engine")
            threading.Thread(target=link.teardown, args=(reason, self.config.stop_timeout_s),
                             name="loom-standby-teardown", daemon=True).start()
        self._failed(reason, refusal, last_lines)

    def _failed(self, reason: str, refusal: str = "", last_lines: list[str] | None = None) -> None:
        self.problem, self.refusal, self.last_lines = reason, refusal, last_lines or []
        delay = self.retry_delay()
        self.failures += 1
        self._next_open = time.monotonic() + delay
        logger.warning("standby engine: %s; the next in %.1f s", reason, delay)

    def retry_delay(self) -> float:
        """The wait before the next standby after this failure: RETRY_S or the first restart delay, doubled for
        each failure in a row before it, up to RETRY_MAX_S or restart_backoff_max_s, whichever is longer."""
        first = max(RETRY_S, self.config.restart_backoff_s)
        return min(first * 2.0 ** self.failures, max(first, RETRY_MAX_S, self.config.restart_backoff_max_s))
