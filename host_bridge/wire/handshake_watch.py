"""Telling a peer that refuses this side's credentials from one that is slow to answer.

ZMQ checks credentials (a session secret over PLAIN, CurveZMQ keys) before a connection exists. A
peer that refuses them closes the connection during the handshake, so no message ever arrives, and
ZMQ does not try again after an explicit refusal (its authenticator's status 400) or a mechanism
mismatch: a connecting side that only waits for an answer waits until its own timeout, and then for
every retry. The socket monitor is the one place ZMQ says why. A connecting socket that presents
credentials is watched here; the loop thread that owns the socket reads the monitor when it polls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

WATCHED_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# A handshake broken off without a reason is what a Curve server does with a client that used the wrong
# server key (it cannot read the client's hello), but also what a peer closing mid-handshake looks like:
# only this many in a row, with no handshake succeeding between them, count as a refusal.
SILENT_FAILURES = 3
_PROTOCOL_ERRORS = {int(getattr(zmq, n)): n[len("PROTOCOL_ERROR_"):] for n in dir(zmq)
                    if n.startswith("PROTOCOL_ERROR_")}


@dataclass(frozen=True)
class HandshakeRefusal:
    """How the peer turned this side's credentials down.

    `kind`: "credentials" (its authenticator refused them), "mechanism" (it uses another kind of
    security: a session secret, CurveZMQ keys, or none), or "handshake" (it broke off every handshake,
    e.g. a Curve server whose public key this side does not have). `detail`: ZMQ's status or error code.
    """

    kind: str
    detail: str


class HandshakeWatch:
    """The monitor of one connecting socket; `refusal` is set, once, when the peer refuses its credentials."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self.socket = sock.get_monitor_socket(WATCHED_EVENTS)  # for the owner's poller
        self.refusal: HandshakeRefusal | None = None
        self.failures = 0  # handshakes failed since the last one that succeeded

    def read(self) -> None:
        """Owner's thread: take the events waiting on the monitor."""
        while True:
            try:
                parts = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = parse_monitor_message(parts)
            except (RuntimeError, ValueError):
                continue  # not a monitor event: nothing to learn from it
            self._on_event(int(event["event"]), int(event["value"]))

    def _on_event(self, event: int, value: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failures = 0
            return
        self.failures += 1
        if self.refusal is not None:
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self.refusal = HandshakeRefusal("credentials", f"status {value}")
        elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            name = _PROTOCOL_ERRORS.get(value, f"protocol error {value:#x}")
            kind = "mechanism" if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH else "handshake"
            self.refusal = HandshakeRefusal(kind, name)
        elif self.failures >= SILENT_FAILURES:
            self.refusal = HandshakeRefusal("handshake", f"{self.failures} handshakes broken off")
        if self.refusal is not None:
            logger.debug("handshake refused: %s", self.refusal)

    def close(self) -> None:
        """Stop monitoring (before the socket closes: a monitor left behind keeps its context from ending)."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket is closed already
        self.socket.close(linger=0)
