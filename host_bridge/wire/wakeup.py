"""Waking the one thread that polls a ZMQ socket, from any other thread.

ZMQ sockets are single-threaded, so a thread that wants the poller to act (send what it queued,
notice a command, close) must not touch the polled socket; it rings an inproc PAIR whose
receiving end sits in the same poller instead. At most one ring is pending (SNDHWM 1): more
rings before the poller wakes add nothing.
"""

from __future__ import annotations

import itertools
import os
import threading

import zmq

_ids = itertools.count()


class Wakeup:
    def __init__(self, ctx: zmq.Context, label: str) -> None:
        addr = f"inproc://loom-{label}-wake-{os.getpid()}-{next(_ids)}"
        self.rx = ctx.socket(zmq.PAIR)  # register this in the poller
        self.rx.setsockopt(zmq.LINGER, 0)
        self.rx.bind(addr)
        self._tx = ctx.socket(zmq.PAIR)
        self._tx.setsockopt(zmq.LINGER, 0)
        self._tx.setsockopt(zmq.SNDHWM, 1)
        self._tx.connect(addr)
        self._lock = threading.Lock()
        self._closed = False

    def ring(self) -> bool:
        """Wake the poller (any thread, never blocks); False once closed."""
        with self._lock:
            if self._closed:
                return False
            try:
                self._tx.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # a ring is already pending
            except zmq.ZMQError:
                return False
        return True

    def drain(self) -> None:
        """Poller thread: consume the pending ring(s)."""
        while self.rx.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # cheaper than catching zmq.Again
            self.rx.recv(zmq.NOBLOCK)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tx.close(linger=0)
            self.rx.close(linger=0)
