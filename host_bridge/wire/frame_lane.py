"""The frame lane: a ZMQ socket of its own for frame notices (with their tcp payloads) and releases.

Used by tcp links; links to an engine on this machine (shm, cuda-ipc) carry the same notices through
a shared-memory doorbell instead (`host_bridge.wire.doorbell`), which has this class's interface.

Why not the control `Channel`: its socket belongs to one loop thread, so a frame sent through it
crossed a thread hand-off on each side (outbox, inproc wake-up, loop, condition), which cost more
than the copies. The lane is used directly by the threads that make and consume frames (on the
host the caller of `submit()`, `latest()`, `wait_for_output()`; in the engine the `FrameWorker`),
so one frame costs one ZMQ hop each way. Handshake, heartbeats, stats and errors stay on the
control channel, answered by the engine's main thread, so liveness is judged as before.

Threads: a ZMQ socket may serve several threads strictly one at a time; `lock` (reentrant) is that
rule. Whoever holds it may `receive()`. `send()` never waits for it: when another thread holds the
lock (it may sit in a poll), the message goes to a small outbox and the holder is woken through an
inproc pair to send it; `release()` sends what others queued meanwhile. Messages a bound lane cannot
deliver yet (its peer has not connected) wait in the same bounded outbox.

Each side accepts only the lane messages meant for it (host: `frame` out and `release` in; engine:
`frame` in and `release` out). Anything else is refused and counted, like anything malformed.

Endpoints: the side that binds the control endpoint binds the lane next to it (the same private
directory for ipc, the same interface on a random port for tcp) and names it in its hello; the other
side connects to it, through `lane_endpoint_for`, and with the control channel's CurveZMQ keys.

Peers: a host that launched its engine binds a lane only that engine can reach (the launch token), so a
DEALER serves. A served engine's lane port can be found by anyone who holds the session secret (a host
waiting to get in, say), and a DEALER would deal the attached host's notices round-robin among every
peer connected: it binds a ROUTER instead (`peer=`), sends only to the one routing id it named in its
hello (the attached host's lane connects with that `identity`), and refuses whatever another peer sends.
Until that peer has connected, its messages wait in the outbox like a DEALER's.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from collections import deque
from typing import Any

import zmq

from loom_live.host_bridge.wire.channel import Auth, EndpointError, apply_curve_keys, check_endpoint
from loom_live.host_bridge.wire.protocol import MAX_PAYLOAD_BYTES, NOTICE_DIRS, ProtocolError, decode, encode, make
from loom_live.host_bridge.wire.wakeup import Wakeup

LANE_HWM = 1000  # far above what slots allow in flight; a send beyond it waits in the outbox
OUTBOX_LIMIT = 256  # notices and releases are bounded by the ring slots; this only stops a runaway
MAX_RECV_PER_CALL = 256
ACCEPTS = {"host": {("frame", "out"), ("release", "in")}, "engine": {("frame", "in"), ("release", "out")}}


def lane_bind_address(control_endpoint: str) -> str:
    """Where a side that bound `control_endpoint` binds its lane: a sibling ipc path or the same tcp host."""
    scheme, _, rest = control_endpoint.partition("://")
    if scheme == "ipc":
        return f"{control_endpoint}-lane-{secrets.token_hex(4)}"
    if scheme == "tcp":
        return f"tcp://{rest.rpartition(':')[0]}:*"
    raise EndpointError(f"control endpoint {control_endpoint!r}: expected tcp:// or ipc://")


def lane_endpoint_for(control_endpoint: str, announced: str) -> str:
    """The lane a connecting side should reach. Over tcp only the port is taken from the peer: the host
    part stays the one the control channel reached (a peer bound to 0.0.0.0 announces that)."""
    scheme, _, rest = control_endpoint.partition("://")
    if announced.partition("://")[0] != scheme:
        raise EndpointError(f"lane endpoint {announced!r} does not match the control endpoint {control_endpoint!r}")
    if scheme == "ipc":
        return announced
    port = announced.rpartition(":")[2]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(f"lane endpoint {announced!r}: expected tcp://HOST:PORT")
    return f"tcp://{rest.rpartition(':')[0]}:{port}"


class FrameLane:
    def __init__(self, ctx: zmq.Context, endpoint: str, *, bind: bool, side: str,
                 curve: Auth | None = None, peer: bytes | None = None, identity: bytes | None = None):
        """`peer`: a ROUTER that talks to that routing id only; `identity`: the routing id this side connects as."""
        if side not in ACCEPTS:
            raise ValueError(f"side: {side!r}; expected 'host' or 'engine'")
        self._accepts = ACCEPTS[side]
        self._frame_dir, self._release_dir = NOTICE_DIRS[side]
        self.lock = threading.RLock()
        self._closed = False
        self._ipc_file: str | None = None
        self.peer = peer
        self.sock = ctx.socket(zmq.ROUTER if peer else zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, LANE_HWM), (zmq.RCVHWM, LANE_HWM),
                           (zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 65536)):
            self.sock.setsockopt(opt, value)
        if peer:  # a message for a peer not (yet) connected fails and waits, instead of vanishing
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        try:
            check_endpoint(endpoint, curve)
            apply_curve_keys(self.sock, curve)
            if bind:
                self.sock.bind(endpoint)
                endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
                if endpoint.startswith("ipc://"):
                    self._ipc_file = endpoint[len("ipc://"):]  # zmq leaves the file: remove it on close
            else:
                self.sock.connect(endpoint)
        except Exception:
            self.sock.close(linger=0)
            raise
        self.endpoint = endpoint
        self._wake = Wakeup(ctx, "lane")
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wake.rx, zmq.POLLIN)
        self._outbox: deque[list[Any]] = deque()
        self._queued = 0  # messages ever put in the outbox: tells `release()` whether others queued some
        self.sent = self.received = self.refused = self.dropped = 0
        self.last_refusal = ""
        self.refused_at = 0.0

    # -- any thread -----------------------------------------------------------------------------------

    def send(self, msg: dict[str, Any], payload: list[Any] | tuple = ()) -> bool:
        """Send now when the lock is free (or already ours), else queue for the holder. Never blocks;
        False when the outbox is full or the lane closed (the message is dropped and counted)."""
        if self._closed or len(self._outbox) >= OUTBOX_LIMIT:
            self.dropped += 1
            return False
        self._outbox.append([self.peer, encode(msg), *payload] if self.peer else [encode(msg), *payload])
        self._queued += 1
        if self.lock.acquire(blocking=False):
            self.release()
        else:
            self.wake()
        return True

    def send_frame(self, slot: int, seq: int, gen: int, payload: list[Any] | tuple = (), control: bool = False) -> bool:
        """A frame notice for `slot` of the ring this side writes (tcp: with the frame as `payload`;
        `control`: the slot holds its control frame too)."""
        return self.send(make("frame", dir=self._frame_dir, slot=slot, seq=seq, gen=gen, t=time.time(),
                              nbytes=len(payload[0]) if payload else None, control=control or None), payload)

    def send_release(self, slot: int, gen: int, dropped: bool = False) -> bool:
        """Hand `slot` of the peer's ring back."""
        return self.send(make("release", dir=self._release_dir, slot=slot, gen=gen, dropped=dropped))

    def wake(self) -> None:
        """Make a thread waiting in `receive()` return now (a queued message, a command, closing)."""
        self._wake.ring()

    def acquire(self, blocking: bool = True, timeout_s: float = -1) -> bool:
        return self.lock.acquire(blocking, timeout_s)

    def release(self) -> None:
        """Let go of the lock; first send what is queued, and whatever another thread queued meanwhile. A send that
        fails (or a Ctrl-C in it) is raised with the lock let go: held, it would stop every later send and close()."""
        while True:
            mark = self._queued
            try:
                self._flush()
            finally:
                self.lock.release()
            if self._queued == mark or self._closed or not self.lock.acquire(blocking=False):
                return  # nothing new, or a new holder sends it

    # -- the lock holder ------------------------------------------------------------------------------

    def receive(self, timeout_s: float) -> list[tuple[dict[str, Any], list[bytes]]]:
        """Lock holder only: wait up to `timeout_s` (0: just look) and return the accepted messages."""
        if self._closed:
            return []
        self._flush()
        ms = math.ceil(timeout_s * 1000) if timeout_s > 0 else 0
        events = dict(self._poller.poll(ms))
        if self._wake.rx in events:
            self._wake.drain()
            self._flush()
        out = []
        if self.sock in events:
            for _ in range(MAX_RECV_PER_CALL):
                if not self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    break
                try:
                    parts = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:  # CurveZMQ: readiness may come from handshake traffic, not a message
                    break
                self.received += 1
                if self.peer and parts.pop(0) != self.peer:
                    self.refuse("frame lane message from a peer that is not the attached host")
                    continue
                try:
                    msg = decode(parts)
                except ProtocolError as exc:
                    self.refuse(str(exc))
                    continue
                except Exception as exc:  # anything unexpected from a peer is refused, never fatal
                    self.refuse(f"unreadable message ({type(exc).__name__})")
                    continue
                if (msg["type"], msg.get("dir")) not in self._accepts:
                    self.refuse(f"{msg['type']} {msg.get('dir', '')} message on the frame lane; it carries only "
                                + " and ".join(f"{t} {d}" for t, d in sorted(self._accepts)))
                    continue
                out.append((msg, parts[1:]))
        return out

    def _flush(self) -> None:
        while self._outbox and not self._closed:
            parts = self._outbox[0]
            try:
                self.sock.send_multipart(parts, zmq.NOBLOCK, copy=len(parts) == 1 + bool(self.peer))
            except zmq.Again:
                return  # a bound lane whose peer has not connected yet: keep it for the next call
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:  # a ROUTER's peer not connected yet (or gone: the outbox is bounded)
                    return
                raise
            self._outbox.popleft()
            self.sent += 1

    def refuse(self, why: str) -> None:
        self.refused += 1
        self.last_refusal = why[:300]
        self.refused_at = time.monotonic()

    def close(self) -> None:
        """Wake a waiting holder, wait for the lock, close the sockets (and a bound ipc file). Idempotent."""
        self.wake()
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self._wake.close()
            self.sock.close(linger=0)
            if self._ipc_file:
                try:
                    os.unlink(self._ipc_file)
                except OSError:
                    pass
