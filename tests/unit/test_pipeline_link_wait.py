"""Rank 0's wait for the last rank's header: the pipeline's long wait inside a push. With a `waiting`
function (the engine server's paced outputs) it is called between short looks, and the peers are still
checked only every POLL_S; without one the wait is as it was."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

import pytest

from loom_live.engine.parallel import link
from loom_live.engine.parallel.link import Header, Kind, Link


def _header_after(conn, delay_s: float) -> threading.Timer:
    timer = threading.Timer(delay_s, lambda: conn.send(Header(Kind.DATA, tick=7)))
    timer.start()
    return timer


def test_the_wait_calls_waiting_between_looks_and_checks_the_peers_at_their_own_pace(monkeypatch):
    monkeypatch.setattr(link, "POLL_S", 0.05)
    ours, theirs = Pipe()
    waited, checked = [], []
    timer = _header_after(theirs, 0.2)
    header = Link.recv_header(ours, lambda: checked.append(1), lambda: waited.append(1))
    timer.join()
    assert header.tick == 7
    assert len(waited) >= 20  # looks every WAIT_LOOK_S: a few hundred in 0.2 s, at least a tenth of them
    assert 1 <= len(checked) <= 5  # every 0.05 s, not at every look


def test_a_failed_peer_check_ends_the_wait_with_waiting_set(monkeypatch):
    monkeypatch.setattr(link, "POLL_S", 0.02)
    ours, _theirs = Pipe()

    def gone():
        raise RuntimeError("rank 1 exited")

    with pytest.raises(RuntimeError, match="rank 1 exited"):
        Link.recv_header(ours, gone, lambda: None)


def test_without_waiting_the_header_still_arrives():
    ours, theirs = Pipe()
    timer = _header_after(theirs, 0.05)
    start = time.monotonic()
    assert Link.recv_header(ours).tick == 7
    timer.join()
    assert time.monotonic() - start < 5
