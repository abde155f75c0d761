"""The control connection: one ZMQ DEALER socket, owned by one loop thread, fed by any thread.

It carries everything except frames: handshake, rings, heartbeats, prompts, parameters, stats,
errors (frame notices and releases travel on the `frame_lane`, and are refused here). ZMQ sockets
are not thread-safe, and control messages come from several threads (the host's `set_prompt()`, the
engine's worker answering a request), so other threads never touch the socket: `send()` encodes
and validates the message, appends it to a bounded outbox and wakes the loop through an inproc
pair; the loop thread calls `poll()`, which flushes the outbox without blocking and returns the
received messages that passed `protocol.decode`. Everything refused is counted, never raised.

Endpoints: a local engine gets `ipc://` in a fresh private directory (mode 0700), or tcp on
127.0.0.1 where ipc is unavailable. A non-loopback tcp endpoint needs CurveZMQ: the engine is the
Curve server (its secret key file, plus a directory of authorised client public keys), the host
is a Curve client (its own certificate file and the engine's public key file); files are the
ones `zmq.auth.create_certificates` writes. The frame lane uses the same keys.
An engine served on a loopback or ipc endpoint without Curve holds a session secret (`SharedSecret`):
ZMQ's PLAIN mechanism checks it before a peer is connected at all, so another local process that does
not hold it can neither drive the engine nor reach it. PLAIN sends the secret in the clear, so it is refused
on a non-loopback endpoint. A peer that refuses a connecting channel's credentials sends nothing at
all; the channel watches its handshakes (`handshake_watch`) and says so (`handshake_refusal`).

A served engine has several peers at once (the host it serves, hosts waiting to get in): its channel is
a ROUTER (`router=True`), which says who sent each message (`poll_from`) and sends each message to the
one peer named (`send(..., to=peer)`); a DEALER would deal its messages round-robin among all of them,
so a waiting host would take the attached host's replies. A message for a peer that has gone is dropped
and counted. A launched engine and every host have exactly one peer: a DEALER.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import zmq

from loom_live.host_bridge.wire.handshake_watch import HandshakeRefusal, HandshakeWatch
from loom_live.host_bridge.wire.protocol import MAX_PAYLOAD_BYTES, ProtocolError, decode, encode, request_id
from loom_live.host_bridge.wire.wakeup import Wakeup

SOCKET_HWM = 1000  # messages queued in ZMQ per direction before sends fail (never block)
OUTBOX_LIMIT = 4096  # messages waiting for the loop thread; beyond that new ones are dropped and counted
MAX_RECV_PER_POLL = 2000  # keep the loop responsive under a flood
RefusedRequest = Callable[[bytes, str, int, str], None]  # (peer, type, id, why) of a request refused with an id


class EndpointError(ValueError):
    """An endpoint that is malformed or not allowed without authentication."""


@dataclass(frozen=True)
class CurveServer:
    """Engine side: its certificate (public + secret) and the directory of authorised client keys."""

    secret_file: str
    authorized_dir: str


@dataclass(frozen=True)
class CurveClient:
    """Host side: its own certificate (public + secret) and the engine's public key file."""

    secret_file: str
    server_public_file: str


@dataclass(frozen=True)
class SharedSecret:
    """A served engine's session secret; `server`: the binding side checks it, the other presents it."""

    secret: str
    server: bool

    def __repr__(self) -> str:
        return f"SharedSecret(server={self.server})"  # never the secret itself in a log or traceback

    @property
    def domain(self) -> str:
        """The ZAP domain of the sockets this secret guards: links of one context (a bridge's engine and
        its standby) are checked against their own secret each."""
        return "loom-" + hashlib.sha256(self.secret.encode()).hexdigest()[:16]


Auth = CurveServer | CurveClient | SharedSecret
PLAIN_USER = b"loom"
SECRET_BYTES = 32


def read_secret_file(path: str, *, create: bool = False) -> str:
    """The session secret in `path`, a file only its owner may read (mode 0600 on POSIX); `create`
    writes a fresh random one when the file does not exist. Raises EndpointError saying what is wrong."""
    import secrets
    import stat

    try:
        if create and not os.path.exists(path):  # in a folder that is missing or not ours: said, not a traceback
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(SECRET_BYTES) + "\n")
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise EndpointError(f"secret file {path}: not a regular file")
        if os.name != "nt" and st.st_mode & 0o077:
            raise EndpointError(f"secret file {path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it; "
                                "expected 600 (chmod 600)")
        with open(path, encoding="utf-8") as f:
            secret = f.read(1024).strip()
    except OSError as exc:
        raise EndpointError(f"secret file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:  # another file picked by mistake (a key, a model)
        raise EndpointError(f"secret file {path}: not a text file; expected one line of 16 to 128 printable "
                            "characters") from None
    if not 16 <= len(secret) <= 128 or not secret.isprintable():
        raise EndpointError(f"secret file {path}: expected one line of 16 to 128 printable characters")
    return secret


_zap_lock = threading.Lock()
_zap_handlers: dict[int, list[Any]] = {}  # id(context) -> [authenticator, channels using it]


def _zap_acquire(ctx: zmq.Context) -> Any:
    """The context's one ZAP authenticator (ZMQ allows one per context), started on first use."""
    from zmq.auth.thread import ThreadAuthenticator

    with _zap_lock:
        entry = _zap_handlers.get(id(ctx))
        if entry is None:
            auth = ThreadAuthenticator(ctx)
            auth.start()
            entry = _zap_handlers[id(ctx)] = [auth, 0]
        entry[1] += 1
        return entry[0]


def _zap_release(ctx: zmq.Context) -> None:
    with _zap_lock:
        entry = _zap_handlers.get(id(ctx))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _zap_handlers[id(ctx)]
            entry[0].stop()


def is_loopback(endpoint: str) -> bool:
    """ipc/inproc are local; tcp is local only on a loopback address."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp" or not rest:
        raise EndpointError(f"endpoint {endpoint!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
    host = urlsplit(f"//{rest}").hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name or interface other than localhost: treat as remote


def check_endpoint(endpoint: str, curve: Auth | None) -> None:
    if not is_loopback(endpoint) and isinstance(curve, SharedSecret):
        raise EndpointError(f"endpoint {endpoint!r} is not a loopback address: a session secret would cross the "
                            "network in the clear; use CurveZMQ keys")
    if not is_loopback(endpoint) and curve is None:
        raise EndpointError(f"endpoint {endpoint!r} is not a loopback address: CurveZMQ keys are required "
                            "(bridge: curve_secret_file + curve_server_public_file; serve: --curve-secret-file "
                            "+ --curve-authorized)")


def apply_curve_keys(sock: zmq.Socket, curve: Auth | None) -> None:
    """Make `sock` a Curve server or client with these certificate files, or a PLAIN one with the session
    secret (the control socket and the frame lane use the same ones). A server also needs a running
    authenticator on its context."""
    if curve is None:
        return
    if isinstance(curve, SharedSecret):
        if curve.server:
            sock.zap_domain = curve.domain.encode()
            sock.plain_server = True
        else:
            sock.plain_username, sock.plain_password = PLAIN_USER, curve.secret.encode()
        return
    import zmq.auth
    public, secret = zmq.auth.load_certificate(curve.secret_file)
    if not secret:
        raise EndpointError(f"{curve.secret_file}: no secret key in this certificate file")
    sock.curve_publickey, sock.curve_secretkey = public, secret
    if isinstance(curve, CurveServer):
        sock.curve_server = True
    else:
        sock.curve_serverkey = zmq.auth.load_certificate(curve.server_public_file)[0]


PRIVATE_DIR_PREFIX = "loom-"


def remove_private_endpoint(endpoint: str) -> None:
    """Remove the private directory of an ipc endpoint made by `PrivateEndpoint` (engine: host is gone)."""
    if not endpoint.startswith("ipc://"):
        return
    folder = os.path.dirname(endpoint[len("ipc://"):])
    if os.path.basename(folder).startswith(PRIVATE_DIR_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


def _sweep_private_dirs() -> None:
    """Remove private endpoint directories whose owner pid is gone (both sides killed at once)."""
    from loom_live.host_bridge.wire.processes import pid_alive

    root = tempfile.gettempdir()
    for name in os.listdir(root):
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] + "-" == PRIVATE_DIR_PREFIX and parts[1].isdigit():
            if not pid_alive(int(parts[1])):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


class PrivateEndpoint:
    """A fresh local endpoint for a launched engine, and the directory to remove afterwards."""

    def __init__(self) -> None:
        self.dir: str | None = None
        if zmq.has("ipc") and os.name != "nt":
            _sweep_private_dirs()
            # mkdtemp creates it mode 0700; the pid in the name lets a later host sweep it after a crash
            self.dir = tempfile.mkdtemp(prefix=f"{PRIVATE_DIR_PREFIX}{os.getpid()}-")
            self.address: str | None = f"ipc://{self.dir}/control"
            self.lane_address: str | None = f"ipc://{self.dir}/lane"
        else:
            self.lane_address = None
            self.address = None  # bind tcp://127.0.0.1 on a random port

    def remove(self) -> None:
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class Channel:
    def __init__(self, ctx: zmq.Context, endpoint: str | None, *, bind: bool,
                 curve: Auth | None = None, identity: bytes | None = None, router: bool = False,
                 family: str | None = None, on_refused_request: RefusedRequest | None = None):
        self._ctx = ctx
        self.router = router
        self.family = family  # an engine's model family: a prompt it refuses is said in its words (protocol.decode)
        # the engine's: a refused request that carries an id is handed to it to answer (protocol.request_id); a
        # host gives none, so it never answers the engine's messages
        self._on_refused_request = on_refused_request
        self.sock = ctx.socket(zmq.ROUTER if router else zmq.DEALER)
        for opt, value in ((zmq.LINGER, 0), (zmq.SNDHWM, SOCKET_HWM), (zmq.RCVHWM, SOCKET_HWM),
                           (zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 65536)):
            self.sock.setsockopt(opt, value)
        if router:  # a message for an unknown or gone peer fails (and is counted) instead of vanishing
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self._auth = None
        self._watch: HandshakeWatch | None = None
        self._ipc_file: str | None = None  # a bound ipc:// path: zmq leaves the file, close() removes it
        try:
            if endpoint is not None:
                check_endpoint(endpoint, curve)
            self._setup_curve(curve)
            if bind:
                if endpoint is None:
                    port = self.sock.bind_to_random_port("tcp://127.0.0.1")
                    endpoint = f"tcp://127.0.0.1:{port}"
                else:
                    try:
                        self.sock.bind(endpoint)  # tcp://HOST:* picks a free port
                    except zmq.ZMQError as exc:  # a port in use (a second `loom serve`), a folder that is not
                        raise EndpointError(f"cannot listen on {endpoint}: {exc.strerror}") from None
                    endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
                    if endpoint.startswith("ipc://"):
                        self._ipc_file = endpoint[len("ipc://"):]
            else:
                if curve is not None:  # a peer that refuses these credentials says so only to a monitor
                    self._watch = HandshakeWatch(self.sock)
                self.sock.connect(endpoint)
        except Exception:
            self.close()
            raise
        self.endpoint = endpoint
        self._wake = Wakeup(ctx, "control")
        self._outbox: deque[list[Any]] = deque()
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wake.rx, zmq.POLLIN)
        if self._watch is not None:
            self._poller.register(self._watch.socket, zmq.POLLIN)
        self.refused = 0
        self.last_refusal = ""
        self.refused_at = 0.0
        self.dropped_messages = 0
        self.sent = 0
        self.received = 0

    def _setup_curve(self, curve: Auth | None) -> None:
        if isinstance(curve, SharedSecret) and curve.server:
            apply_curve_keys(self.sock, curve)
            self._auth = _zap_acquire(self._ctx)
            self._auth.configure_plain(domain=curve.domain, passwords={PLAIN_USER.decode(): curve.secret})
        elif isinstance(curve, CurveServer):
            if not os.path.isdir(curve.authorized_dir):
                raise EndpointError(f"{curve.authorized_dir}: not a directory of authorised client keys")
            apply_curve_keys(self.sock, curve)  # checks the certificate before an authenticator starts
            self._auth = _zap_acquire(self._ctx)
            self._auth.configure_curve(domain="*", location=curve.authorized_dir)
        else:
            apply_curve_keys(self.sock, curve)

    def send(self, msg: dict[str, Any], payload: list[Any] | tuple = (), *, to: bytes | None = None) -> bool:
        """Queue a message from any thread; never blocks. False when the outbox is full (dropped). A router
        channel sends it to peer `to` only, and drops (and counts) one addressed to nobody."""
        parts = [encode(msg), *payload]
        if self.router:
            if to is None:
                self.dropped_messages += 1
                return False
            parts.insert(0, to)
        if len(self._outbox) >= OUTBOX_LIMIT:
            self.dropped_messages += 1
            return False
        self._outbox.append(parts)
        return self._wake.ring()  # False: closing

    def _flush(self) -> None:
        while self._outbox:
            parts = self._outbox[0]
            try:
                self.sock.send_multipart(parts, zmq.NOBLOCK, copy=len(parts) == 1 + self.router)
            except zmq.Again:
                return  # the peer is slow or absent: keep the rest (bounded by OUTBOX_LIMIT)
            except zmq.ZMQError as exc:  # router: that peer is gone (EHOSTUNREACH); the others still get theirs
                self._outbox.popleft()
                self.dropped_messages += 1
                if exc.errno != zmq.EHOSTUNREACH:
                    self.refuse(f"cannot send to a peer: {exc}")
                continue
            self._outbox.popleft()
            self.sent += 1

    def poll(self, timeout_s: float) -> list[tuple[dict[str, Any], list[bytes]]]:
        """Loop thread only: send what is queued, wait up to `timeout_s`, return decoded messages."""
        return [(msg, payload) for _, msg, payload in self.poll_from(timeout_s)]

    def poll_from(self, timeout_s: float) -> list[tuple[bytes, dict[str, Any], list[bytes]]]:
        """`poll`, with the peer each message came from (a router channel's routing id; b"" otherwise)."""
        self._flush()
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        if self._wake.rx in events:
            self._wake.drain()
            self._flush()
        if self._watch is not None and self._watch.socket in events:
            self._watch.read()
        out = []
        if self.sock in events:
            for _ in range(MAX_RECV_PER_POLL):
                try:
                    parts = self.sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.received += 1
                peer = parts.pop(0) if self.router else b""
                try:
                    out.append((peer, decode(parts, self.family), parts[1:]))
                except ProtocolError as exc:
                    self._refuse_message(peer, parts, str(exc))
                except Exception as exc:  # anything unexpected from a peer is refused, never fatal
                    self._refuse_message(peer, parts, f"unreadable message ({type(exc).__name__})")
        return out

    def _refuse_message(self, peer: bytes, parts: list[bytes], why: str) -> None:
        """Count a received message `decode` refused; a request its sender waits on goes to `on_refused_request`."""
        self.refuse(why)
        request = request_id(parts) if self._on_refused_request is not None else None
        if request is not None:
            self._on_refused_request(peer, *request, why)

    def refuse(self, why: str) -> None:
        self.refused += 1
        self.last_refusal = why[:300]
        self.refused_at = time.monotonic()

    @property
    def handshake_refusal(self) -> HandshakeRefusal | None:
        """How the peer refused this side's credentials (a connecting channel that presents some), else None."""
        return self._watch.refusal if self._watch is not None else None

    @property
    def context(self) -> zmq.Context:
        return self._ctx

    @property
    def pending(self) -> int:
        return len(self._outbox)

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket; `linger_s`: how long messages already handed to the socket may still take
        to leave (the default drops them: a host must never wait on a peer that is gone)."""
        wake = getattr(self, "_wake", None)
        if wake is not None:
            wake.close()
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self.sock.close(linger=int(linger_s * 1000))
        if self._ipc_file:
            with contextlib.suppress(OSError):
                os.unlink(self._ipc_file)
            self._ipc_file = None
        if self._auth is not None:
            _zap_release(self._ctx)
            self._auth = None
