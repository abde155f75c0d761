"""A STUN server on loopback for the web host's ICE tests: it answers every Binding request, telling
each asker that its public address is MAPPED_HOST (a documentation address, TEST-NET-3), so a peer
that used this server shows a server-reflexive candidate with that address in its SDP."""

from __future__ import annotations

import socket
import threading

from aioice import stun

MAPPED_HOST = "203.0.113.7"


class StunServer:
    """`with StunServer() as s:` listens on 127.0.0.1:s.port; `s.askers` are the source addresses it answered."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.askers: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="test-stun", daemon=True)

    def __enter__(self) -> StunServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, addr = self._sock.recvfrom(2048)
                request = stun.parse_message(data)
            except (TimeoutError, ValueError):
                continue
            except OSError:
                return
            if request.message_method != stun.Method.BINDING or request.message_class != stun.Class.REQUEST:
                continue
            self.askers.add(addr)
            reply = stun.Message(message_method=stun.Method.BINDING, message_class=stun.Class.RESPONSE,
                                 transaction_id=request.transaction_id)
            reply.attributes["XOR-MAPPED-ADDRESS"] = (MAPPED_HOST, addr[1])
            reply.add_fingerprint()
            self._sock.sendto(bytes(reply), addr)
