"""`loom serve`: a StreamSession behind the bridge protocol.

Two ways to meet a host. Launched by a host (`--connect`): the host bound a private endpoint and
passed a token in the environment; the engine connects, says hello, and exits when the host says
bye, when SIGTERM arrives, when its parent process dies, or when the host falls silent. Serving
(`--bind`): the engine waits for hosts (over tcp with CurveZMQ unless loopback); a host that leaves
or goes silent frees the engine for the next one. It serves one host at a time, and every message it
sends goes to that host alone (a ROUTER socket names each message's peer): a host that says hello
meanwhile hears only that it waits, and nothing else it sends is acted on or keeps the attached
host's session alive.

Two paths per host. The main thread runs the control loop below (handshake, heartbeats, ring
attachment, requests, stats); it keeps answering heartbeats while the session is busy, which is how
the host tells a busy engine from a hung one. A `FrameWorker` thread owns the session and the path
of frame notices and releases, which it polls itself: the host's shared-memory doorbell when its
hello names one (shm and cuda-ipc, see `host_bridge.wire.doorbell`), else the frame lane socket (tcp, see
`host_bridge.wire.frame_lane`); the control loop hands it commands through `FrameWorker.post`. The side
that bound the control endpoint binds the lane and names it in its hello (launched: the host;
serving: this engine, once per host, as a ROUTER that talks only to the identity its hello gives the host).
Malformed messages, and frame messages on the control channel, are refused and counted, never
fatal; the host's malformed request that carries an id is answered with the refusal (`error`), as one the
session refuses is, so a host waiting on it hears why. Rings are only attached here: the host owns and
removes them, except when the host is gone, then the engine removes the shared memory it knew about
before it exits.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from loom_live.engine.server.frame_worker import FrameWorker
from loom_live.engine.session_api import EngineSession
from loom_live.host_bridge.wire.channel import (
    Channel,
    CurveServer,
    EndpointError,
    SharedSecret,
    remove_private_endpoint,
)
from loom_live.host_bridge.wire.doorbell import Doorbell, DoorbellError
from loom_live.host_bridge.wire.errors import EXIT_USER_ERROR
from loom_live.host_bridge.wire.frame_lane import FrameLane, lane_bind_address, lane_endpoint_for
from loom_live.host_bridge.wire.handoff_marks import ENV as MARKS_ENV
from loom_live.host_bridge.wire.handoff_marks import MARKS
from loom_live.host_bridge.wire.processes import pid_alive
from loom_live.host_bridge.wire.protocol import LANE_MESSAGES, MAX_TEXT, REQUESTS, TRANSPORTS, RingSpec, make
from loom_live.host_bridge.wire.rings import TransportUnavailable, attach_ring
from loom_live.host_bridge.wire.rings.shm import sweep_stale_segments

TICK_S = 0.05
EXIT_OK = 0
EXIT_SESSION_FAILED = 1
LAST_WORDS_S = 0.5  # an exiting engine's queued messages may take this long to leave (a gone host: no longer)
EXIT_HOST_LOST = 3
EXIT_NO_HANDSHAKE = 4
WORKER_JOIN_S = 5.0  # a session call may be this slow to return before the rings are closed under it
EXIT_JOIN_S = 0.5  # exiting: do not wait longer for a busy session (the worker thread is a daemon)
BYE_JOIN_S = 1.5  # a launched engine told bye: time for its session to close, under the host's 2 s wait

# To stderr (see host_bridge.wire.logs): the launching host keeps its tail for its status. When the host
# died, the pipe it read from is gone: logging swallows that OSError.
log = logging.getLogger(__name__)


def offered_transports() -> list[str]:
    from loom_live.host_bridge.wire.rings.cuda import cuda_available

    return [t for t in TRANSPORTS if t != "cuda-ipc" or cuda_available()[0]]


def parent_alive(pid: int | None) -> bool:
    """Whether the launching host still runs (POSIX: also whether we were reparented)."""
    if pid is None:
        return True
    if os.name != "nt" and os.getppid() != pid:
        return False
    return pid_alive(pid)


class EngineServer:
    def __init__(self, session_factory: Callable[[], EngineSession], *, connect: str | None = None,
                 bind: str | None = None,
                 token: str = "", parent_pid: int | None = None, heartbeat_s: float = 0.2,
                 host_timeout_s: float = 5.0, handshake_timeout_s: float = 20.0,
                 curve: CurveServer | SharedSecret | None = None,
                 stall_after: int | None = None, start: dict[str, Any] | None = None):
        if (connect is None) == (bind is None):
            raise ValueError("give exactly one of connect (launched by a host) or bind (serve hosts)")
        if bind is not None and isinstance(curve, SharedSecret):
            token = curve.secret  # a served host proves it holds the secret in its hello too
        self._factory = session_factory
        self._connect, self._bind = connect, bind
        self._token = token
        self._parent_pid = parent_pid
        self._heartbeat_s = heartbeat_s
        self._host_timeout_s = host_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self._curve = curve
        self._stall_after = stall_after
        self._start = start  # what the session starts on (its config's prompt and parameters): the ready info's
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self.channel: Channel | None = None
        self.worker: FrameWorker | None = None
        self.refused_semantic = 0
        self.refusal = ""  # why the session could not be built from its inputs (the engine then exits with 2)
        # the attached host's hello token and whether it said anything since (with its pid: how a hello it
        # repeats before our answer reaches it is told from another host's); the last second host refused
        self._host_peer: bytes | None = None  # the attached host's routing id (b"": launched, one peer)
        self._host_spoke = False  # it said something after its hello: a hello from it now is refused
        self._refused_hello: bytes | None = None  # the last peer whose refused hello was counted
        self.stop_signal: int | None = None

    def request_stop(self, signum: int | None = None, *_: Any) -> None:
        """Stop serving; a signal is remembered so that `run` ends with the shell's code for it
        (130 after Ctrl-C, 143 after SIGTERM), as `loom play` does."""
        if isinstance(signum, int):
            self.stop_signal = signum
        self._stop.set()

    def run(self) -> int:
        self._install_signals()
        MARKS.role = "engine"
        try:
            family = (self._start or {}).get("family")  # a prompt the channel refuses is said in its words
            answer = self._answer_refused  # a refused request with an id is answered, not left to time out
            if self._connect:
                self.channel = Channel(self._ctx, self._connect, bind=False, identity=b"engine",
                                       curve=self._launch_guard(), family=family, on_refused_request=answer)
            else:
                self.channel = Channel(self._ctx, self._bind, bind=True, curve=self._curve, router=True,
                                       family=family, on_refused_request=answer)
                log.info("listening on %s", self.channel.endpoint)
            code = self._serve()
            return 128 + self.stop_signal if self.stop_signal and code == 0 else code
        finally:
            self._end_session(remove=False, join_s=EXIT_JOIN_S)
            if MARKS.enabled:  # a handoff breakdown run: the benchmark reads this side's stamps
                self._dump_marks()
            if self.channel is not None:
                self.channel.poll(0)  # what is still queued (the worker's last error, a bye) goes out...
                self.channel.close(linger_s=LAST_WORDS_S)  # ...and gets a moment to reach the host
            self._ctx.term()

    def _dump_marks(self) -> None:
        try:
            log.info("handoff marks written to %s", MARKS.dump(os.environ[MARKS_ENV]))
        except (OSError, RuntimeError) as exc:  # a worker still stamping (it outlived the join), a full disk
            log.warning("handoff marks not written: %s: %s", type(exc).__name__, exc)

    def _launch_guard(self) -> SharedSecret | None:
        """Launched on tcp: the host checks our launch token before it connects us (any local process can
        reach 127.0.0.1); on ipc its private directory already keeps others out."""
        return SharedSecret(self._token, server=False) if self._connect.startswith("tcp://") and self._token else None

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        if hasattr(signal, "SIGHUP"):  # its terminal closed: stop as cleanly as for Ctrl-C
            signal.signal(signal.SIGHUP, self.request_stop)
        if hasattr(signal, "SIGBREAK"):  # Windows: CTRL_BREAK_EVENT from the launcher
            signal.signal(signal.SIGBREAK, self.request_stop)

    # -- the loop -------------------------------------------------------------------------------------------

    def _serve(self) -> int:
        ch = self.channel
        host_pid: int | None = None
        started = time.monotonic()
        last_heard = started
        last_beat = 0.0
        if self._connect:
            self._send_hello()
        while not self._stop.is_set():
            for peer, msg, payload in ch.poll_from(TICK_S):
                if self.worker is not None and peer != self._host_peer:
                    self._from_other_peer(peer, msg)  # never keeps the attached host's session alive
                    continue
                last_heard = time.monotonic()
                try:
                    outcome = self._on_message(peer, msg, payload)
                except Exception as exc:  # an odd message is refused and counted, never fatal, and answered
                    why = f"{msg['type']} message: {type(exc).__name__}: {exc}"
                    ch.refuse(why)
                    if msg["type"] in REQUESTS and msg.get("id") is not None:
                        self._answer_refused(peer, msg["type"], msg["id"], why)
                    continue
                if outcome == EXIT_OK:
                    return EXIT_OK
                if outcome != "same":
                    host_pid = outcome
            now = time.monotonic()
            if self.worker is not None and now - last_beat >= self._heartbeat_s:
                last_beat = now
                busy = self.worker.busy_since
                self._to_host(make("heartbeat", t=time.time(), busy_s=None if busy is None else now - busy))
            if self.worker is not None and (self.worker.error and self.worker.session is None
                                            or not self.worker.thread.is_alive()):
                if self.worker.refusal:  # its inputs (config, weights) cannot make a session: said by `run`'s caller
                    self.refusal = self.worker.refusal
                    return EXIT_USER_ERROR
                log.error("the frame worker ended: %s", self.worker.error or "unexpectedly")
                return EXIT_SESSION_FAILED
            lost = self._host_lost(now, last_heard, started, host_pid)
            if lost:
                had_host = self.worker is not None
                self._end_session(remove=True)  # clean up first: the host's pipe may be gone too
                log.warning("%s", lost)
                if self._connect:
                    host_gone = not parent_alive(self._parent_pid)
                    if had_host or host_gone:
                        remove_private_endpoint(self._connect)
                    if host_gone and not had_host:  # its doorbell, never attached: removed with the dead host's
                        sweep_stale_segments()
                    return EXIT_HOST_LOST if had_host or host_gone else EXIT_NO_HANDSHAKE
                host_pid = None
        self._end_session(remove=False)
        self._say_bye("engine stopping")
        return EXIT_OK

    def _on_message(self, peer: bytes, msg: dict[str, Any], payload: list[bytes] = ()) -> int | str | None:
        """Act on one control message from the attached host, or from any peer while none is attached:
        returns EXIT_OK to exit, "same" when the host is unchanged, else the new host's pid (None: no host)."""
        ch, kind = self.channel, msg["type"]
        if kind == "hello":
            if not self._token_ok(msg):
                ch.refuse("hello from a peer that is not our host (wrong token or session secret)")
                return "same"
            if self.worker is not None:  # the attached host itself (others go to _from_other_peer)
                if self._host_spoke and self._refused_hello != peer:  # counted once, however often repeated
                    self._refused_hello = peer
                    ch.refuse("hello again from the attached host after its handshake")
                else:  # said again before our answer reached it (a connecting host repeats it until answered)
                    log.debug("hello again from the attached host")
                return "same"
            lane = self._open_lane(peer, msg)
            if lane is None:
                return "same"
            self._host_peer, self._host_spoke, self._refused_hello = peer, False, None
            if self._bind:
                self._send_hello(None if isinstance(lane, Doorbell) else lane)
            self._start_worker(lane)
            return msg["pid"]
        if self.worker is None:
            ch.refuse(f"{kind} before hello")
            return "same"
        self._host_spoke = True
        if kind == "bye":
            if self._connect and self.worker.session is None:  # still building it: `run` gives it a moment
                return EXIT_OK
            # a built session is closed here, with time to finish (a pipeline's ranks, their rendezvous
            # folder): `run` gives a still busy session only a moment on its way out
            self._end_session(remove=False, join_s=BYE_JOIN_S if self._connect else WORKER_JOIN_S)
            return EXIT_OK if self._connect else None
        self._dispatch(kind, msg, payload)
        return "same"

    def _token_ok(self, hello: dict[str, Any]) -> bool:
        return hello["role"] == "host" and not ((self._connect or self._token) and hello["token"] != self._token)

    def _from_other_peer(self, peer: bytes, msg: dict[str, Any]) -> None:
        """A message from a peer that is not the attached host (served: one that holds the secret too). One
        that says hello as a host is told that it waits, and counted once however often it repeats it; its
        bye is let go; anything else is refused and counted. Nothing of it reaches the session."""
        ch = self.channel
        if msg["type"] == "bye":
            return  # a waiting host that gives up: nothing to do
        if msg["type"] != "hello" or not self._token_ok(msg):
            ch.refuse(f"{msg['type']} message from a peer that is not the attached host")
            return
        if peer != self._refused_hello:
            self._refused_hello = peer
            ch.refuse("hello from a second host while one is attached")
        ch.send(make("wait", reason="the engine serves another host; this host gets in when that one leaves"),
                to=peer)

    def _answer_refused(self, peer: bytes, kind: str, rid: int, why: str) -> None:
        """A request of the attached host that the channel refused (`protocol.decode`: counted there), or that
        failed where it was acted on, is answered with the refusal under its id, as the worker answers one its
        session refuses: a host waiting on it hears why (an engine of another version refusing a value) instead
        of timing out. Nobody else's is answered: a
        waiting host hears only that it waits, and before its hello a peer is nobody's host yet."""
        if self.worker is not None and peer == self._host_peer:
            self._to_host(make("error", id=rid, code=kind, message=why[:MAX_TEXT]))

    def _to_host(self, msg: dict[str, Any], payload: list[Any] | tuple = ()) -> bool:
        """Send to the attached host, and to nobody else."""
        return self.channel.send(msg, payload, to=self._host_peer)

    def _host_lost(self, now: float, last_heard: float, started: float, host_pid: int | None) -> str | None:
        # also before the host's hello: a host killed while this engine started must not leave it waiting
        # out the handshake timeout
        if self._connect and not parent_alive(self._parent_pid):
            return f"parent process {self._parent_pid} is gone"
        if self.worker is None:
            if self._connect and now - started > self._handshake_timeout_s:
                return f"no hello from the host within {self._handshake_timeout_s:.0f} s"
            return None
        if now - last_heard > self._host_timeout_s:
            return f"host silent for {now - last_heard:.1f} s"
        return None

    def _send_hello(self, lane: FrameLane | None = None) -> None:
        """Served on tcp, it names the lane bound for this host and the identity the host's lane connects as."""
        from loom_live.host_bridge.wire.rings.cuda import all_uuids

        msg = make("hello", role="engine", token=self._token, pid=os.getpid(),
                   lane=lane.endpoint if lane else None, lane_id=lane.peer.decode() if lane and lane.peer else None,
                   transports=offered_transports(), gpu_uuids=all_uuids()[:64], software="loom engine")
        self.channel.send(msg, to=self._host_peer if self._bind else None)

    def _open_lane(self, peer: bytes, hello: dict[str, Any]) -> FrameLane | Doorbell | None:
        """The host's doorbell when its hello names one. Else, launched: connect to the lane the hello
        names; serving: bind a fresh one for this host."""
        try:
            if "doorbell" in hello:
                return Doorbell.attach(hello["doorbell"])
            if self._connect:
                if "lane" not in hello:
                    raise EndpointError("the host's hello names no frame lane (a host of an older protocol?)")
                return FrameLane(self._ctx, lane_endpoint_for(self._connect, hello["lane"]), bind=False,
                                 side="engine", curve=self._launch_guard())
            return FrameLane(self._ctx, lane_bind_address(self.channel.endpoint), bind=True, side="engine",
                             curve=self._curve, peer=secrets.token_hex(16).encode())  # the attached host's alone
        except (EndpointError, DoorbellError, ValueError, OSError) as exc:  # zmq.ZMQError is an OSError
            self.channel.refuse(f"hello: no frame lane: {exc}")
            self.channel.send(make("error", code="handshake", message=f"frame lane: {exc}"[:4000]), to=peer)
            return None

    def _say_bye(self, reason: str) -> None:
        self._to_host(make("bye", reason=reason))
        self.channel.poll(0)

    def _start_worker(self, lane: FrameLane | Doorbell) -> None:
        peer = self._host_peer  # a worker answers its own host, also a busy one that outlives its session

        def send(msg: dict[str, Any], payload: list[Any] | tuple = ()) -> bool:
            return self.channel.send(msg, payload, to=peer)

        self.worker = FrameWorker(self._factory, send, lane, stall_after=self._stall_after, start=self._start)
        self.worker.thread.start()

    def _end_session(self, remove: bool, join_s: float = WORKER_JOIN_S) -> None:
        """Stop the worker, let go of the rings and the lane or doorbell (remove = the host is gone, delete
        its segments). A worker still busy in a session call holds neither the rings' lock nor the lane's,
        and finds both closed when it returns."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        if not worker.halt(join_s):
            log.warning("the session is still busy; closing its rings and lane under it")
        worker.close_rings(remove)
        lane = worker.lane  # the worker holds the lane's lock only while it polls or sends
        if remove and isinstance(lane, Doorbell):
            lane.remove()
        else:
            lane.close()

    def _dispatch(self, kind: str, msg: dict[str, Any], payload: list[bytes] = ()) -> None:
        w, ch = self.worker, self.channel
        if kind == "heartbeat":
            return
        if kind in LANE_MESSAGES:
            ch.refuse(f"{kind} message on the control channel; frames travel on the frame lane")
        elif kind == "ring":
            self._attach(msg)
        elif kind in ("mode", "prompt", "params", "reset", "flush"):
            w.post(kind, msg)  # answered by the worker, in order with the frames it has taken
        elif kind == "reference":  # the image (checked against its size by `decode`) goes with the command
            w.post(kind, {**msg, "image": payload[0] if payload else None})
        elif kind == "stats":
            self._to_host(make("stats", id=msg.get("id"), data=self.stats()))
        else:
            ch.refuse(f"unexpected {kind} message from the host")

    def _attach(self, msg: dict[str, Any]) -> None:
        spec = RingSpec.from_dict(msg["spec"])
        try:
            ring = attach_ring(spec)
        except (OSError, ValueError, RuntimeError, TransportUnavailable) as exc:
            self._to_host(make("error", id=msg.get("id"), code="ring",
                               message=f"cannot attach the {spec.transport} {spec.dir} ring: {exc}"[:4000]))
            return
        self.worker.post("ring", msg, ring)  # installed and acknowledged between two frames

    def stats(self) -> dict[str, Any]:
        w, ch = self.worker, self.channel
        lane = w.lane if w is not None else None
        data: dict[str, Any] = {"pid": os.getpid(), "refused": ch.refused, "last_refusal": ch.last_refusal,
                                "dropped_messages": ch.dropped_messages, "control_received": ch.received}
        if lane is not None:
            data["refused"] += lane.refused
            if lane.refused_at > ch.refused_at:
                data["last_refusal"] = lane.last_refusal
            data.update(dropped_messages=ch.dropped_messages + lane.dropped, lane_received=lane.received)
        if w is not None:
            data.update(w.counts)
            data["time_ms"] = w.time.report()
            data["lossless"] = w.lossless
            data["error"] = w.error or ""
            data["session"] = w.session_stats
        return data
