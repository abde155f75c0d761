"""The bridge's background thread: keeps one engine linked, and says how that is going.

It owns the control side of the current `Link`: it opens the link (launching or connecting to the
engine), handshakes, answers and sends heartbeats, asks for stats, files the engine's replies for
the host threads that wait on them, and on a crash, exit, hang or bad message tears the link down
and opens a new one after a backoff that doubles up to a limit (and resets once an engine has run
for a while). Frames are not its business: each tick it calls back into the bridge (`on_tick`) to
drain the frame lane and hand over a pending frame, and when an engine becomes ready it lets the
bridge send what that engine must know (`on_ready`). It shares the bridge's lock (`cond`); every
field here is read and written under it, and it never tears a link down while holding it: host
threads must never wait on a dying engine.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from host_bridge.bridge_stats import FrameStats
from host_bridge.config import BridgeConfig
from host_bridge.link import Link
from host_bridge.link_open import LinkOpenError, open_link
from host_bridge.standby import Standby
from host_bridge.wire.protocol import LANE_MESSAGES

STATS_INTERVAL_S = 1.0
STABLE_AFTER_S = 10.0  # running this long resets the restart backoff
TICK_S = 0.05
REPLIES_KEPT = 64  # replies nobody collected (the asker timed out) are forgotten beyond this many


class EngineLoop:
    def __init__(self, config: BridgeConfig, ctx: zmq.Context, lock: threading.RLock, cond: threading.Condition,
                 stats: FrameStats, on_ready: Callable[[Link], None], on_tick: Callable[[Link], None]):
        self.config = config
        self._ctx = ctx
        self._lock = lock  # the bridge's lock; `cond` is a condition on it
        self._cond = cond
        self._stats = stats
        self._on_ready = on_ready  # called with the lock held
        self._on_tick = on_tick  # called without the lock
        self.link: Link | None = None
        self.state = "stopped"
        self.message = ""
        self.last_error = ""
        self.log_tail: list[str] = []  # the last engine's output, kept once its link is gone
        self.restarts = 0
        self.closing = False
        self.request_ids = itertools.count(1)  # ids of requests (the bridge's and the stats polls) and replies
        self.replies: dict[int, dict[str, Any]] = {}
        self._thread: threading.Thread | None = None
        self._backoff = config.restart_backoff_s
        self._next_start = 0.0
        self._link_ids = itertools.count()
        # a second launched engine kept ready to take over (opened once the first one runs)
        self.standby = Standby(config, ctx, lock, self._link_ids) if config.standby and config.launch else None

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def link_id(self) -> int:
        return self.link.id if self.link is not None else -1

    def start(self) -> None:
        self.state = "starting"
        self._thread = threading.Thread(target=self._run, name="loom-bridge", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread and tear the link down (stopping a launched engine)."""
        self.closing = True
        if self._thread is not None:
            self._thread.join(timeout=self.config.stop_timeout_s * 3 + 5)
        with self._cond:
            link, self.link = self.link, None
        if link is not None:
            link.teardown("closed", self.config.stop_timeout_s)
        if self.standby is not None:
            self.standby.close()

    def set_state(self, state: str, message: str) -> None:
        with self._cond:
            self.state, self.message = state, message
            self._cond.notify_all()

    def _run(self) -> None:
        while not self.closing:
            try:
                self._step()
            except Exception as exc:  # a bug or a driver error must not silently stop the bridge
                link = self.link
                reason = f"bridge error: {type(exc).__name__}: {exc}"
                if link is not None:
                    self._fail(link, reason)
                else:
                    self.set_state("restarting", reason)
                    time.sleep(TICK_S)

    def _step(self) -> None:
        """One turn of the loop thread: (re)connect, receive, act, check liveness."""
        link = self.link
        if self.standby is not None:  # a new standby only once an engine runs: they would load side by side
            self.standby.step(open_new=link is not None and link.ready)
            if link is None and self.state != "dead":
                with self._cond:
                    if self._adopt_standby("engine restarted from the standby"):
                        return
        if link is None:
            if self.state == "dead" or time.monotonic() < self._next_start:
                time.sleep(TICK_S)
            else:
                self._open_link()
            return
        try:
            messages = link.channel.poll(TICK_S)
        except zmq.ZMQError as exc:
            self._fail(link, f"control socket error: {exc}")
            return
        for msg, payload in messages:
            try:
                problem = self._handle(link, msg, payload)
            except Exception as exc:  # an odd message is refused and counted, never fatal
                link.channel.refuse(f"{msg['type']} message: {type(exc).__name__}: {exc}")
                continue
            if problem:  # torn down outside the lock: host threads must never wait on a dying engine
                self._fail(link, problem)
                return
        self._tick(link, time.monotonic())

    def _open_link(self) -> None:
        cfg = self.config
        try:
            link = open_link(self._ctx, cfg, self._link_ids, self._lock)
        except LinkOpenError as exc:
            self.set_state("dead", str(exc))
            return
        with self._cond:
            self.link = link
            self.set_state("starting" if self.restarts == 0 else "restarting",
                           "launching the engine" if cfg.launch else f"connecting to {cfg.endpoint}")
        if not cfg.launch:
            link.send_hello()

    def _handle(self, link: Link, msg: dict[str, Any], payload: list[bytes]) -> str | None:
        """Act on one control message; returns a reason to give up on this engine, or None."""
        kind = msg["type"]
        link.heard()
        with self._cond:
            if kind == "heartbeat":
                link.engine_busy_s = msg.get("busy_s") or 0.0
            elif kind == "hello":
                return link.on_hello(msg)
            elif kind == "ready":
                if not link.hello_done:
                    link.channel.refuse("ready before hello")
                    return None
                link.on_ready(msg.get("info") or {})
                self.set_state("running", "engine running")
                self._on_ready(link)
            elif kind == "status":
                self.message = msg.get("message", "")
                if msg["state"] == "error":
                    self.last_error = self.message
            elif kind in LANE_MESSAGES:
                link.channel.refuse(f"{kind} message on the control channel; frames travel on the frame lane")
            elif kind in ("ack", "flushed", "stats", "error") and msg.get("id") is not None:
                self._on_reply(link, kind, msg)
            elif kind == "ack":
                pass  # the answer to a request nobody waits for (sent without an id)
            elif kind == "error":
                self.last_error = self.message = f"engine error: {msg['message']}"
                self._stats.counts["errors"] += 1
            elif kind == "bye":
                return f"engine said bye: {msg.get('reason', '')}"
            else:
                link.channel.refuse(f"unexpected {kind} message from the engine")
        return None

    def _on_reply(self, link: Link, kind: str, msg: dict[str, Any]) -> None:
        """A reply to a request: the link's own (ring acks, stats polls) or one a host thread waits for."""
        if kind == "stats":
            self._stats.engine = msg.get("data") or {}
        if kind == "ack" and msg["id"] in link.ring_requests:
            link.retire_older(link.ring_requests.pop(msg["id"]))
        elif kind != "stats" or msg["id"] not in link.stats_requests:
            self.replies[msg["id"]] = msg
            if len(self.replies) > REPLIES_KEPT:
                self.replies.pop(next(iter(self.replies)))
        link.stats_requests.discard(msg["id"])
        if kind == "error":
            self.last_error = msg["message"]
            self._stats.counts["errors"] += 1
        self._cond.notify_all()

    def _tick(self, link: Link, now: float) -> None:
        problem = link.check(now)
        if problem:
            self._fail(link, problem)
            return
        link.maybe_heartbeat(now)
        if link.ready and now - link.last_stats > STATS_INTERVAL_S:
            link.request_stats(next(self.request_ids))
        if link.ready and now - link.ready_at > STABLE_AFTER_S:
            self._backoff = self.config.restart_backoff_s
        self._on_tick(link)

    def _fail(self, link: Link, reason: str) -> None:
        """Tear the link down (outside the lock: stopping a process takes time) and plan a restart, or
        switch to the standby engine at once when one is ready."""
        with self._cond:
            if self.link is not link:
                return
            if self._switch_to_standby(link, reason):
                return
            self.link = None
            self.log_tail = link.log_tail()
            # said now: a host must not see 'running' (and send to no link) while a hung engine is stopped
            restart = self.config.restart and not self.closing
            self.set_state("restarting" if restart else "dead", f"{reason}; stopping the engine")
        link.teardown(reason, self.config.stop_timeout_s)
        with self._cond:
            self.log_tail = link.log_tail()
            if self.config.restart and not self.closing:
                self.restarts += 1
                self._next_start = time.monotonic() + self._backoff
                self.set_state("restarting", f"{reason}; restarting in {self._backoff:.1f} s")
                self._backoff = min(max(self._backoff * 2, 0.1), self.config.restart_backoff_max_s)
            else:
                self.set_state("dead", reason)

    def _switch_to_standby(self, link: Link, reason: str) -> bool:
        """Lock held: the ready standby becomes the engine in use; the failed one is stopped on a thread of
        its own (a hung engine takes seconds to stop, and the new one needs this thread to talk to it)."""
        if not self._adopt_standby(f"{reason}; switched to the standby engine"):
            return False
        self.restarts += 1
        threading.Thread(target=link.teardown, args=(reason, self.config.stop_timeout_s),
                         name="loom-engine-teardown", daemon=True).start()
        return True

    def _adopt_standby(self, message: str) -> bool:
        """Lock held: make the ready standby the engine in use, if there is one."""
        fresh = self.standby.take() if self.standby is not None and not self.closing else None
        if fresh is None:
            return False
        self.link = fresh
        self.set_state("running", message)
        self._on_ready(fresh)
        return True
