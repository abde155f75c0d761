"""The supervisor: the bridge's background thread that keeps one engine linked, and says how that is going.

It owns the control side of the current `Link`: it opens the link (launching or connecting to the
engine), handshakes, answers and sends heartbeats, asks for stats, files the engine's replies for
the host threads that wait on them, and on a crash, exit, hang or bad message tears the link down
and opens a new one after a backoff that doubles up to a limit (and resets once an engine has run
for a while). Restarts are for engines that were running: a launched engine that exits before the
first one was ever ready (a wrong engine Python, a missing module, a crash while loading) would fail
the same way again, so the supervisor ends there at once (dead, with the reason and the engine's last
lines) instead of retrying it silently until a host's timeout; unless a standby launched beside it still
loads, which is then waited for (see `_wait_for_standby`); one that failed already is named beside it
(`_standby_failed_already`). An engine that exits with code 2 before
it is ready (the one in use, or a standby waited for) refused its run (a bad config, missing weights),
whether or not one ran before: the message is then the engine's own error, said once. So does a served
engine that refuses this host's session secret or CurveZMQ keys: every new link would present them
again. Frames are not its business: each tick it hands the link to the frame side (a `FrameSide`:
the bridge) to drain the frame lane and hand over a pending frame, and when an engine becomes ready
it lets the frame side send what that engine must know.

It owns the engine lock and its condition (`lock`, `cond`): its own fields, the link, and the
bridge's frame state are read and written under them, so the bridge takes them from here. It never
tears a link down while holding the lock: host threads must never wait on a dying engine.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from enum import Enum
from typing import Any, Protocol

import zmq

from loom_live.host_bridge.config import BridgeConfig
from loom_live.host_bridge.launcher import LOG_TAIL_SHOWN
from loom_live.host_bridge.link import Link
from loom_live.host_bridge.link_open import LinkOpenError, open_link
from loom_live.host_bridge.standby import Standby
from loom_live.host_bridge.wire.protocol import LANE_MESSAGES

STATS_INTERVAL_S = 1.0
STABLE_AFTER_S = 10.0  # running this long resets the restart backoff
TICK_S = 0.05
REPLIES_KEPT = 64  # replies nobody collected (the asker timed out) are forgotten beyond this many

log = logging.getLogger(__name__)


class EngineState(str, Enum):
    """Where the engine is, as hosts show it; each member is its own status text ("running", ...)."""

    STOPPED = "stopped"  # not started yet, or closed
    STARTING = "starting"  # the first engine is launching, connecting or loading
    RUNNING = "running"  # an engine is ready and takes frames
    RESTARTING = "restarting"  # the engine failed; a fresh one is on its way
    DEAD = "dead"  # failed and not restarted (restart off, or it cannot be launched at all)

    # the plain text wherever a state is shown or compared: f-strings, str(), dict keys, JSON
    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__

    @property
    def ended(self) -> bool:
        """No engine is coming without a new start."""
        return self in (EngineState.DEAD, EngineState.STOPPED)


class FrameSide(Protocol):
    """What the supervisor calls on the bridge, with the link it concerns."""

    def on_engine_ready(self, link: Link) -> None:
        """A fresh engine is ready (called with the lock held): tell it what the host wants."""

    def on_tick(self, link: Link) -> None:
        """The loop thread's turn at the frames (called without the lock)."""


class Supervisor:
    """Keeps one engine linked for one bridge: its state, its replies, its restarts, and the engine lock.

    Public fields are read under `lock` by the bridge and written only here (`note` is the host's way
    to add a remark); requests a host thread waits on get their id and reply through the methods below.
    """

    def __init__(self, config: BridgeConfig, ctx: zmq.Context) -> None:
        self.config = config
        self._ctx = ctx
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        # weak: a host that drops its bridge without closing it must not find the engine kept by this thread
        self._frames: Callable[[], FrameSide | None] = lambda: None
        self.link: Link | None = None
        self.state = EngineState.STOPPED
        self.message = ""
        self.last_error = ""
        self.errors = 0  # error messages from engines
        self.engine_report: dict[str, Any] = {}  # the engine's latest stats report
        self.log_tail: list[str] = []  # the last engine's output, kept once its link is gone
        self.refusal = ""  # the engine's own error when it refused its run (exit code 2); nothing restarts then
        self.restarts = 0
        self.ever_ready = False  # an engine of this bridge has been ready once: later failures are restarted
        self.closing = False
        self._request_ids = itertools.count(1)  # ids of requests (the host's and the stats polls) and replies
        self._replies: dict[int, dict[str, Any]] = {}
        self._thread: threading.Thread | None = None
        self._refused = False  # start() was refused (refuse_start): started, with the reason as the state's message
        self._backoff = config.restart_backoff_s
        self._next_start = 0.0
        self._link_ids = itertools.count()
        # why the engine in use failed before its first ready, while the standby it waits for loads
        self._lost_before_ready = ""
        # a second launched engine kept ready to take over (opened once the first one runs)
        self.standby = Standby(config, ctx, self.lock, self._link_ids) if config.standby and config.launch else None

    @property
    def started(self) -> bool:
        """start() was called: an engine is kept linked, or the start was refused (calls then say why, not
        that the bridge was never started)."""
        return self._thread is not None or self._refused

    @property
    def link_id(self) -> int:
        return self.link.id if self.link is not None else -1

    def start(self, frames: FrameSide) -> None:
        """Begin keeping an engine linked; `frames` is called on each tick and for each fresh engine."""
        self._frames = weakref.ref(frames)
        self.state = EngineState.STARTING
        self._thread = threading.Thread(target=self._run, name="loom-bridge", daemon=True)
        self._thread.start()

    def refuse_start(self, reason: str) -> None:
        """The host cannot use an engine at all (e.g. its transport is unavailable here)."""
        self._refused = True
        self._set_state(EngineState.DEAD, reason)

    def stop(self) -> None:
        """End the thread and tear the link down (stopping a launched engine); the state is then stopped."""
        self.closing = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.config.stop_timeout_s * 3 + 5)
        with self.cond:  # stopped with the link gone, in one step: a host thread waiting on it says "closed"
            link, self.link = self.link, None
            self.state, self.message = EngineState.STOPPED, "closed"
            self.cond.notify_all()
        if link is not None:
            link.teardown("closed", self.config.stop_timeout_s)
        if self.standby is not None:
            self.standby.close()

    def note(self, message: str, *, error: bool = False) -> None:
        """A host thread's remark on the engine (a message it could not send, a frame it could not hand over)."""
        with self.cond:
            self.message = message
            if error:
                self.last_error = message

    # --- requests a host thread waits on (call with the lock held) ---------------------------

    def new_request_id(self) -> int:
        return next(self._request_ids)

    def has_reply(self, rid: int) -> bool:
        return rid in self._replies

    def take_reply(self, rid: int) -> dict[str, Any] | None:
        return self._replies.pop(rid, None)

    # --- the loop thread ---------------------------------------------------------------------

    def _set_state(self, state: EngineState, message: str) -> None:
        with self.cond:
            self.state, self.message = state, message
            self.cond.notify_all()

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
                    self._set_state(EngineState.RESTARTING, reason)
                    time.sleep(TICK_S)

    def _step(self) -> None:
        """One turn of the loop thread: (re)connect, receive, act, check liveness."""
        link = self.link
        if self.standby is not None and self.state == EngineState.DEAD:
            # a dead bridge takes no engine over: a standby would only hold a process and its model's memory
            self.standby.close()  # until the host closes the bridge
        elif self.standby is not None:  # a new standby once an engine runs (or launched with it: side by side)
            self.standby.step(open_new=link is not None and (link.ready or self.config.standby_start == "together"),
                              beside_show=link is not None and link.ready)
            if link is None:
                with self.cond:
                    if self._adopt_standby("engine restarted from the standby"):
                        return
                    if self._lost_before_ready and self.standby.link is None:
                        lost, self._lost_before_ready = self._lost_before_ready, ""
                        self._standby_failed_too(lost)
        if link is None:
            if self.state == EngineState.DEAD or self._lost_before_ready or time.monotonic() < self._next_start:
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
            link = open_link(self._ctx, cfg, self._link_ids, self.lock)
        except LinkOpenError as exc:
            self._set_state(EngineState.DEAD, str(exc))
            return
        with self.cond:
            self.link = link
            self._set_state(EngineState.STARTING if self.restarts == 0 else EngineState.RESTARTING,
                            "launching the engine" if cfg.launch else f"connecting to {cfg.endpoint}")
        if not cfg.launch:
            link.send_hello()

    def _handle(self, link: Link, msg: dict[str, Any], payload: list[bytes]) -> str | None:
        """Act on one control message; returns a reason to give up on this engine, or None."""
        kind = msg["type"]
        link.heard()
        if not link.hello_done and not link.cfg.launch and kind not in ("hello", "bye", "wait") \
                and not (kind == "error" and msg.get("code") == "handshake"):
            link.channel.refuse(f"{kind} message from the engine before its hello")
            return None
        with self.cond:
            if kind == "wait":
                if link.hello_done or link.cfg.launch:
                    link.channel.refuse("wait message after the handshake")
                    return None
                link.waiting()  # the engine is there and serves another host: keep saying hello
                self.message = f"waiting: the engine at {link.channel.endpoint} serves another host; this host " \
                               "gets in when that one leaves"
                self.cond.notify_all()
            elif kind == "heartbeat":
                link.engine_busy_s = msg.get("busy_s") or 0.0
            elif kind == "hello":
                return link.on_hello(msg)
            elif kind == "ready":
                if not link.hello_done:
                    link.channel.refuse("ready before hello")
                    return None
                link.on_ready(msg.get("info") or {})
                self.ever_ready = True
                self._set_state(EngineState.RUNNING, "engine running")
                if (frames := self._frames()) is not None:
                    frames.on_engine_ready(link)
            elif kind == "status":
                self.message = msg.get("message", "")
                if msg["state"] == "error":
                    self.last_error = self.message
            elif kind in LANE_MESSAGES:
                link.channel.refuse(f"{kind} message on the control channel; frames travel on the frame lane")
            elif kind in ("ack", "flushed", "stats", "error") and msg.get("id") is not None:
                return self._on_reply(link, kind, msg)
            elif kind == "ack":
                pass  # the answer to a request nobody waits for (sent without an id)
            elif kind == "error" and msg.get("code") == "handshake" and not link.cfg.launch \
                    and not link.hello_done:
                self.errors += 1
                return link.refuse_lane(msg["message"])
            elif kind == "error":
                self.last_error = self.message = f"engine error: {msg['message']}"
                self.errors += 1
            elif kind == "bye":
                return f"engine said bye: {msg.get('reason', '')}"
            else:
                link.channel.refuse(f"unexpected {kind} message from the engine")
        return None

    def _on_reply(self, link: Link, kind: str, msg: dict[str, Any]) -> str | None:
        """A reply to a request: the link's own (ring acks, stats polls) or one a host thread waits for.
        An engine that cannot use a ring the host already writes into would never free its slots: every
        later frame would be dropped behind a link that looks alive, so that engine is given up."""
        if kind == "stats":
            self.engine_report = msg.get("data") or {}
        if msg["id"] in link.ring_requests:
            generation = link.ring_requests.pop(msg["id"])
            if kind == "error":
                self.last_error = msg["message"]
                self.errors += 1
                return f"the engine cannot use the host's frame ring: {msg['message']}"
            link.retire_older(generation)
        elif kind != "stats" or msg["id"] not in link.stats_requests:
            self._replies[msg["id"]] = msg
            if len(self._replies) > REPLIES_KEPT:
                self._replies.pop(next(iter(self._replies)))
        link.stats_requests.discard(msg["id"])
        if kind == "error":
            self.last_error = msg["message"]
            self.errors += 1
        self.cond.notify_all()
        return None

    def _tick(self, link: Link, now: float) -> None:
        problem = link.check(now)
        if problem:
            self._fail(link, problem)
            return
        link.maybe_heartbeat(now)
        if link.ready and now - link.last_stats > STATS_INTERVAL_S:
            link.request_stats(self.new_request_id())
        if link.ready and now - link.ready_at > STABLE_AFTER_S:
            self._backoff = self.config.restart_backoff_s
        if (frames := self._frames()) is not None:
            frames.on_tick(link)

    def _fail(self, link: Link, reason: str) -> None:
        """Tear the link down (outside the lock: stopping a process takes time) and plan a restart, or
        switch to the standby engine at once when one is ready. An engine that refused its run is not
        restarted: the state becomes dead with its reason."""
        # Only before it was ready: a refusal is about the run's settings, checked at start; an engine that
        # ran and then exits is a crash whatever its code, and a show gets a fresh one.
        refusal = None if link.ready else link.refusal()  # before the lock: it may wait for the last output
        with self.cond:
            if self.link is not link:
                return
            if refusal is None and self._switch_to_standby(link, reason):
                return
            self.link = None
            if refusal is not None:
                self.refusal = self.last_error = refusal
                # a launched engine's refusal is its own error; a served engine's refusal of this host's
                # credentials says itself which engine refused what
                reason = f"the engine refused to start: {refusal}" if link.proc is not None else refusal
            # said now: a host must not see 'running' (and send to no link) while a hung engine is stopped
            elif self._never_started(link):
                reason = f"the engine could not start: {reason}"
            restart = self.config.restart and not self.closing and refusal is None and not self._never_started(link)
            ends = not restart and refusal is None
            waiting = ends and self._wait_for_standby(link, reason)
            # said with the standby's failure, before the state is seen: a refusal of its must reach the host
            both = ends and not waiting and self._standby_failed_already(link)
            # named while a standby is waited for, or once it failed: its lines join these (`_standby_failed_too`)
            named = "engine" if waiting or both else ""
            self.log_tail = link.log_tail(named)
            if both:
                self._standby_failed_too(reason)
            elif not waiting:
                self._set_state(EngineState.RESTARTING if restart else EngineState.DEAD,
                                reason if not restart else f"{reason}; stopping the engine")
        link.teardown(reason, self.config.stop_timeout_s)
        with self.cond:
            self.log_tail = link.log_tail(named)  # with what it said while stopping
            if both:
                self.log_tail = _shared_tail(self.log_tail, self.standby.last_lines)
            elif restart and not self.closing:
                self.restarts += 1
                self._next_start = time.monotonic() + self._backoff
                self._set_state(EngineState.RESTARTING, f"{reason}; restarting in {self._backoff:.1f} s")
                self._backoff = min(max(self._backoff * 2, 0.1), self.config.restart_backoff_max_s)
            elif not waiting:
                self._set_state(EngineState.DEAD, reason)

    def _never_started(self, link: Link) -> bool:
        """A launched engine exited before any engine of this bridge was ready: trying again would fail alike.
        (One that is slow to say hello or hangs while loading on a busy machine is still tried again.)"""
        return link.proc is not None and not link.proc.alive and not link.ready and not self.ever_ready

    def _wait_for_standby(self, link: Link, reason: str) -> bool:
        """Lock held: whether to wait for the standby instead of ending. The engine in use failed before it was
        ready and is not retried, while a standby launched beside it still loads: that one may well start (the
        first load ran out of memory, the second finds room), so the bridge keeps starting and adopts it once
        ready. The wait is bounded by the standby link's own handshake and load timeouts, as any engine's is."""
        loading = self.standby.link if self.standby is not None and not self.closing else None
        if link.ready or loading is None:
            return False
        self._lost_before_ready = reason
        self._set_state(EngineState.STARTING if self.restarts == 0 else EngineState.RESTARTING,
                        f"{reason}; waiting for the standby engine (pid {loading.pid}) to finish loading")
        log.warning("%s", self.message)
        return True

    def _standby_failed_already(self, link: Link) -> bool:
        """Lock held: the engine in use failed before its first ready, with no standby loading to wait for, after
        the standby launched beside it had failed during this start (no standby was ready since): the bridge ends
        as when a standby waited for fails too, so the host learns why neither engine started, whichever went
        first. An older failure, followed by a standby that was ready, is no part of this start."""
        standby = self.standby
        return standby is not None and not link.ready and standby.link is None and standby.failures > 0

    def _standby_failed_too(self, lost: str) -> None:
        """Lock held: the engine in use did not start (`lost` says why) and the standby launched beside it went
        away before it was ready too (it exited, hung, or ran past its timeouts; while waited for, or before):
        the bridge ends, naming both engines' causes, with both engines' last lines. A standby that refused its
        run (exit code 2) ends it as the engine in use's refusal does: `refusal` is its own error, for the same
        run's settings refused by one engine are refused by both, and that is what the user must fix."""
        standby = self.standby
        self.log_tail = _shared_tail(self.log_tail, standby.last_lines)
        if standby.refusal:
            self.refusal = self.last_error = standby.refusal
            why = f"the standby engine refused to start: {standby.refusal}"
        else:
            why = f"the standby engine could not start either: {standby.problem}"
        self._set_state(EngineState.DEAD, f"{lost}; {why}")
        log.error("%s", self.message)

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
        if self._lost_before_ready:  # it replaces an engine that failed before its first ready: said, and counted
            message, self._lost_before_ready = f"{self._lost_before_ready}; the standby engine took over", ""
            self.restarts += 1
            log.info("%s", message)
        self.link = fresh
        self.ever_ready = True  # a standby is taken ready: a later failure is restarted, not a failed start
        self._set_state(EngineState.RUNNING, message)
        if (frames := self._frames()) is not None:
            frames.on_engine_ready(fresh)
        return True


def _shared_tail(first: list[str], second: list[str], lines: int = LOG_TAIL_SHOWN) -> list[str]:
    """Two engines' last lines within one engine's bound: each keeps at least half of it, and what one does
    not use is the other's."""
    kept_second = min(len(second), max(lines // 2, lines - len(first)))
    kept_first = min(len(first), lines - kept_second)
    return first[len(first) - kept_first:] + second[len(second) - kept_second:]
