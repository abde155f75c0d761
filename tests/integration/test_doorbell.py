"""The shared-memory doorbell that carries frame notices and releases on shm and cuda-ipc links.

What a host and an engine rely on: notices arrive once, in order, across wrap-around and across
processes; a full ring refuses a send instead of overwriting; a torn, corrupt or out-of-range record
is refused and counted and the stream goes on; every wait keeps its timeout and stays cheap when idle;
the segment is private and disappears on close and after either side is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from loom_live.host_bridge.wire import doorbell as db
from loom_live.host_bridge.wire.arrival_spin import ArrivalSpin
from loom_live.host_bridge.wire.doorbell import Doorbell, DoorbellError
from loom_live.host_bridge.wire.protocol import PROTOCOL_VERSION, decode, encode, make
from loom_live.host_bridge.wire.rings import create_ring
from loom_live.host_bridge.wire.rings.shm import open_segment
from tests.fakes.engines import GuardedSockets

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
posix_only = pytest.mark.skipif(not SHM.is_dir() or not zmq.has("ipc"), reason="needs /dev/shm and ipc endpoints")


@pytest.fixture
def pair():
    host = Doorbell.create()
    engine = Doorbell.attach(host.name)
    yield host, engine
    engine.close()
    host.close()


def _take(side: Doorbell, timeout_s: float = 1.0) -> list[dict]:
    with side.lock:
        return [msg for msg, payload in side.receive(timeout_s)]


class RawWriter:
    """Writes the host's record ring by hand, following the documented layout (to forge bad records)."""

    def __init__(self, name: str, ring: int = 0):
        self._shm = open_segment(name, create=False)
        self.words = np.ndarray((self._shm.size // 8,), np.uint64, buffer=self._shm.buf)
        self.base = db.HEADER_WORDS + ring * db.RING_WORDS
        self.index = int(self.words[self.base])

    def record(self, index: int) -> int:
        return self.base + 2 * db.COUNTER_WORDS + (index % db.CAPACITY) * db.RECORD_WORDS

    def write(self, info: int, seq: int, gen: int, *, torn: bool = False, publish: bool = True) -> None:
        stamp, t_ns = self.index + 1, time.time_ns()
        check = db._check(stamp, info, seq, gen, t_ns)
        rec = self.record(self.index)
        self.words[rec:rec + 6] = [stamp, info, seq ^ (1 if torn else 0), gen, t_ns, check]
        if publish:
            self.publish()

    def publish(self) -> None:
        self.index += 1
        self.words[self.base] = self.index

    def consumed(self) -> int:
        return int(self.words[self.base + db.COUNTER_WORDS])

    def close(self) -> None:
        del self.words
        self._shm.close()


def test_notices_arrive_once_in_order_through_wrap_around(pair):
    host, engine = pair
    got = []
    for seq in range(3 * db.CAPACITY + 5):  # in bursts that wrap the ring three times
        assert host.send_frame(seq % 3, seq, 7)
        if seq % 50 == 49:
            got += _take(engine, 0)
    got += _take(engine, 0)
    assert [m["seq"] for m in got] == list(range(3 * db.CAPACITY + 5))
    assert all(m["type"] == "frame" and m["dir"] == "in" and m["gen"] == 7 and m["slot"] == m["seq"] % 3 for m in got)
    assert abs(got[-1]["t"] - time.time()) < 5
    assert engine.send_release(2, 7, dropped=True) and engine.send_frame(1, 99, 7)
    v = PROTOCOL_VERSION
    assert _take(host) == [{"v": v, "type": "release", "dir": "in", "slot": 2, "gen": 7, "dropped": True},
                           {"v": v, "type": "frame", "dir": "out", "slot": 1, "seq": 99, "gen": 7,
                            "t": pytest.approx(time.time(), abs=5)}]
    assert engine.received == 3 * db.CAPACITY + 5 and engine.refused == 0 and host.received == 2
    with pytest.raises(ValueError, match="tcp"):
        host.send_frame(0, 1, 1, [b"pixels"])
    sent = host.sent
    for bad in ((16, 1, 1), (-1, 1, 1), (0, -1, 1), (0, 1, 2**63)):  # a sender's bug fails at the sender
        with pytest.raises(ValueError, match="slot below 16"):
            host.send_frame(*bad)
    assert host.sent == sent and _take(engine, 0) == []


def test_a_frame_notice_says_when_its_slot_holds_a_control_frame(pair):
    host, engine = pair
    assert host.send_frame(1, 5, 7, control=True) and host.send_frame(2, 6, 7)
    first, second = _take(engine, 0)
    assert first["control"] is True and first["slot"] == 1 and "control" not in second
    assert engine.send_release(1, 7) and "control" not in _take(host)[0]


def test_a_full_ring_refuses_sends_until_the_reader_catches_up(pair):
    host, engine = pair
    assert all(host.send_release(i % 16, 1) for i in range(db.CAPACITY))
    assert not host.send_release(0, 1) and host.dropped == 1  # nothing unread was overwritten
    assert len(_take(engine, 0)) == db.CAPACITY
    assert host.send_release(3, 1) and _take(engine)[0]["slot"] == 3


def test_torn_corrupt_and_out_of_range_records_are_refused_and_counted(pair):
    host, engine = pair
    raw = RawWriter(host.name)
    try:
        raw.write(db.KIND_FRAME | 2 << 8, 10, 1, publish=False)  # counter first, body later (weak ordering)
        rec = raw.record(raw.index)
        body = raw.words[rec:rec + 6].copy()
        raw.words[rec + 1] = 0
        raw.publish()
        assert _take(engine, 0) == [] and engine.refused == 0  # not verified yet: looked at again later
        raw.words[rec + 1] = body[1]
        assert [m["seq"] for m in _take(engine, 0)] == [10] and engine.refused == 0

        raw.write(db.KIND_FRAME | 1 << 8, 11, 1, torn=True)  # never verifies
        raw.write(db.KIND_FRAME | 1 << 8, 12, 1)
        t0 = time.monotonic()
        got = []
        while not got and time.monotonic() - t0 < 10:
            got = _take(engine, 0.005)
        assert [m["seq"] for m in got] == [12] and engine.refused == 1 and "torn or corrupt" in engine.last_refusal
        assert time.monotonic() - t0 < db.RECORD_GRACE_S + 2  # skipped after its grace, not left blocking

        bad = [db.KIND_FRAME | 16 << 8, db.KIND_RELEASE | 255 << 8, 7 | 1 << 8, db.KIND_FRAME | db.FLAG_DROPPED << 16,
               db.KIND_RELEASE | 4 << 16]
        for info in bad:
            raw.write(info, 0, 1)
        raw.write(db.KIND_FRAME, 2**63, 1)  # a seq beyond the protocol's range
        raw.write(db.KIND_RELEASE | 5 << 8, 0, 3)
        assert [(m["type"], m["slot"]) for m in _take(engine, 0)] == [("release", 5)]
        assert engine.refused == 1 + len(bad) + 1 and "slot" in engine.last_refusal

        raw.index += 10 * db.CAPACITY  # a counter far ahead of anything written: corrupt
        raw.words[raw.base] = raw.index
        assert _take(engine, 0) == [] and "counter" in engine.last_refusal
        raw.write(db.KIND_FRAME | 3 << 8, 13, 1)  # the reader started again where the counter says
        assert [m["seq"] for m in _take(engine, 0)] == [13] and raw.consumed() == raw.index
    finally:
        raw.close()


def test_waits_keep_their_timeout_and_wake_early(pair):
    host, engine = pair
    t0 = time.monotonic()
    assert _take(engine, 0.2) == []
    assert 0.19 <= time.monotonic() - t0 < 1.0
    # a waiting reader returns as soon as a record comes (from another thread), or when woken
    threading.Timer(0.05, lambda: host.send_frame(0, 1, 1)).start()
    t0 = time.monotonic()
    assert len(_take(engine, 5)) == 1 and time.monotonic() - t0 < 1
    threading.Timer(0.05, engine.wake).start()
    t0 = time.monotonic()
    assert _take(engine, 5) == [] and time.monotonic() - t0 < 1
    # idle waiting is sleeping, not spinning: a small part of one core
    c0, t0 = time.thread_time(), time.monotonic()
    _take(engine, 0.5)
    assert (time.thread_time() - c0) / (time.monotonic() - t0) < 0.3
    # closing wakes a waiter in another thread
    done = []
    waiter = threading.Thread(target=lambda: done.append(_take(engine, 10)))
    waiter.start()
    time.sleep(0.05)
    t0 = time.monotonic()
    engine.close()
    waiter.join(2)
    assert done == [[]] and time.monotonic() - t0 < 1
    assert not engine.send_frame(0, 1, 1)  # closed: refused, counted, no crash
    assert engine.dropped == 1


def test_attach_refuses_what_is_not_a_doorbell():
    for name in ("../etc/passwd", "loom_1_zz", "loom_999999_0123abcd"):
        with pytest.raises(DoorbellError):
            Doorbell.attach(name)
    ring = create_ring("shm", "in", slots=2, width=64, height=64)  # a loom segment, but a frame ring
    try:
        with pytest.raises(DoorbellError, match="not a doorbell"):
            Doorbell.attach(ring.spec.handles[0])
    finally:
        ring.close()


@pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")
def test_the_segment_is_private_and_its_owner_removes_it():
    host = Doorbell.create()
    path = SHM / host.name
    assert path.stat().st_mode & 0o777 == 0o600
    engine = Doorbell.attach(host.name)
    engine.close()  # the engine only lets go
    assert path.exists()
    host.close()
    host.close()
    assert not path.exists()
    other = Doorbell.create()
    Doorbell.attach(other.name).remove()  # an engine whose host died removes it
    assert not (SHM / other.name).exists()
    other.close()


PEER = textwrap.dedent("""
    import sys
    from loom_live.host_bridge.wire.doorbell import Doorbell
    side = Doorbell.create() if sys.argv[1] == "create" else Doorbell.attach(sys.argv[2])
    print(side.name, flush=True)
    with side.lock:
        while True:  # echo: every frame notice back as a release of that slot and a notice of the same seq
            for msg, _ in side.receive(5.0):
                side.send_release(msg["slot"], msg["gen"])
                side.send_frame(msg["slot"], msg["seq"], msg["gen"])
""")


def _peer(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", PEER, *args], stdout=subprocess.PIPE, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")
def test_two_processes_round_trip_in_order_and_a_killed_side_leaves_nothing():
    host = Doorbell.create()
    engine = _peer("attach", host.name)
    try:
        assert engine.stdout.readline().decode().strip() == host.name
        for seq in range(2000):
            assert host.send_frame(seq % 3, seq, 1)
            got: list[dict] = []
            while len(got) < 2:
                more = _take(host, 5)
                assert more, f"no answer to notice {seq}"
                got += more
            assert [(m["type"], m["slot"]) for m in got] == [("release", seq % 3), ("frame", seq % 3)]
            assert got[1]["seq"] == seq
        assert host.refused == 0
        engine.send_signal(signal.SIGKILL)
        engine.wait()
    finally:
        engine.kill()
        host.close()
    assert not (SHM / host.name).exists()
    owner = _peer("create")  # a host killed with its doorbell: the next doorbell made here sweeps it
    name = owner.stdout.readline().decode().strip()
    assert (SHM / name).exists()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    Doorbell.create().close()
    assert not (SHM / name).exists()


def _recv(sock: zmq.Socket, kind: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decode(sock.recv_multipart())
            if msg["type"] == kind:
                return msg
    raise AssertionError(f"no {kind} message within {timeout_s} s")


def _stats(host: zmq.Socket) -> dict:
    host.send(encode(make("stats", id=99)))
    return _recv(host, "stats")["data"]


@posix_only
def test_engine_server_refuses_bad_records_and_keeps_serving(tmp_path):
    """A real `loom serve` process reading forged records from its host's doorbell."""
    ctx = zmq.Context()
    host = ctx.socket(zmq.DEALER)
    host.setsockopt(zmq.LINGER, 0)
    host.bind(f"ipc://{tmp_path}/ctl")
    bell = Doorbell.create()
    env = {**os.environ, "LOOM_BRIDGE_TOKEN": "secret", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "loom_live.engine", "serve", "--connect", f"ipc://{tmp_path}/ctl",
                             "--passthrough", "--parent-pid", str(os.getpid())], cwd=ROOT, env=env)
    rings = [create_ring("shm", d, slots=3, width=8, height=8, generation=1) for d in ("in", "out")]
    raw = RawWriter(bell.name)
    try:
        assert _recv(host, "hello")["role"] == "engine"
        host.send(encode(make("hello", role="host", token="secret", pid=os.getpid(), doorbell=bell.name)))
        _recv(host, "ready")
        rng = np.random.default_rng(3)
        expected = 0
        for i in range(600):
            while raw.index - raw.consumed() >= db.CAPACITY:
                time.sleep(0.001)
            kind = i % 6
            if kind == 0:
                raw.write(int(rng.integers(3, 256)) | int(rng.integers(0, 16)) << 8, 1, 1)  # unknown kind
            elif kind == 1:
                raw.write(db.KIND_FRAME | int(rng.integers(16, 256)) << 8, 1, 1)  # slot beyond any ring
            elif kind == 2:
                raw.write(db.KIND_RELEASE | 1 << 8 | int(rng.integers(2, 2**40)) << 16, 0, 1)  # unknown flags
            elif kind == 3 and i % 30 == 3:
                raw.write(db.KIND_FRAME, 1, 1, torn=True)  # never verifies: refused after the grace time
            else:
                raw.write(db.KIND_RELEASE | 2 << 8, 0, 1)  # harmless: an output slot never published
                continue
            expected += 1
        host.send(encode(make("heartbeat", t=time.time())))
        deadline = time.monotonic() + 20
        while (stats := _stats(host)).get("refused") != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats["refused"] == expected, stats["last_refusal"]
        assert proc.poll() is None
        # still serving: a real frame through real rings, notice and release through the doorbell
        for rid, ring in enumerate(rings):
            host.send(encode(make("ring", id=rid + 1, spec=ring.spec.to_dict())))
            assert _recv(host, "ack")["id"] == rid + 1
        frame = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        rings[0].write(1, frame)
        raw.write(db.KIND_FRAME | 1 << 8, 4242, 1)
        got: list[dict] = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += _take(bell, 0.1)
        notice = next(m for m in got if m["type"] == "frame")
        assert notice["seq"] == 4242 and np.array_equal(rings[1].read(notice["slot"], []), frame)
        releases = [(m["dir"], m["slot"], m["gen"]) for m in got if m["type"] == "release"]
        assert releases == [("in", 1, 1)]  # the input slot came back
        host.send(encode(make("bye", reason="test over")))
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raw.close()
        for ring in rings:
            ring.close()
        bell.close()
        host.close()
        ctx.term()


def test_bridge_refuses_bad_records_from_its_engine_and_never_blocks(tmp_path):
    """A Bridge on shm reading forged records from a fake engine's side of the doorbell."""
    from loom_live.host_bridge import Bridge, BridgeConfig

    ctx = zmq.Context()
    guard = GuardedSockets(ctx, tmp_path)
    engine, port = guard.bind()
    bridge = Bridge(BridgeConfig(launch=False, endpoint=f"tcp://127.0.0.1:{port}", transport="shm",
                                 restart=False, secret_file=guard.secret_file)).start()
    raw = None
    try:
        hello = _recv(engine, "hello")
        assert "lane" not in hello and bridge.stats()["segments"] == [hello["doorbell"]]
        engine.send(encode(make("hello", role="engine", token="", pid=os.getpid(), transports=["shm"])))
        engine.send(encode(make("ready", info={})))
        bridge.wait_running(10)
        raw = RawWriter(hello["doorbell"], ring=1)  # the engine's ring
        expected = stale = 0
        for i in range(300):
            while raw.index - raw.consumed() >= db.CAPACITY:
                bridge.latest()
            if i % 3 == 0:
                raw.write(db.KIND_FRAME | (16 + i % 200) << 8, i, 1)  # slot beyond any ring
            elif i % 3 == 1:
                raw.write(9 | 1 << 8, i, 1)  # unknown kind
            elif i % 30 == 2:
                raw.write(db.KIND_FRAME | 1 << 8, i, 1, torn=True)
            else:
                raw.write(db.KIND_FRAME | 1 << 8, i, 0)  # valid, of a generation long gone: stale, not refused
                stale += 1
                continue
            expected += 1
            if i % 50 == 0:
                t0 = time.monotonic()
                bridge.submit(np.zeros((8, 8, 3), np.uint8))
                frame, status = bridge.latest()
                # a call that waited on the flood of bad records would take seconds
                # (shown as starting: the fake engine never sends a restyled frame; running, not failed)
                assert time.monotonic() - t0 < 1.0 and frame is not None and status.state == "starting"
                engine.send(encode(make("heartbeat", t=time.time())))
        deadline = time.monotonic() + 10
        while bridge.stats()["refused"] + bridge.stats()["stale"] < expected + stale and time.monotonic() < deadline:
            engine.send(encode(make("heartbeat", t=time.time())))
            bridge.latest()
            time.sleep(0.01)
        stats = bridge.stats()
        assert (stats["refused"], stats["stale"]) == (expected, stale), stats["last_refusal"]
        assert bridge.status().state == "running"
    finally:
        if raw is not None:
            raw.close()
        bridge.close()
        guard.close()
        ctx.term()


def test_a_reader_spinning_around_paced_arrivals_loses_nothing_and_rests_when_idle(pair):
    host, engine = pair
    engine.pace = ArrivalSpin(0.002)  # the widest window allowed, so the spin engages on a loaded box
    frames, period = 40, 0.01

    def produce():
        t0 = time.monotonic()
        for seq in range(1, frames + 1):
            time.sleep(max(t0 + seq * period - time.monotonic(), 0.0))
            host.send_frame(seq % 4, seq, 1)

    got, cpu = [], {}

    def consume():
        c0 = time.thread_time()
        end = time.monotonic() + 60
        while len(got) < frames and time.monotonic() < end:
            got.extend(m["seq"] for m in _take(engine, 0.5))
        cpu["paced"], c0 = time.thread_time() - c0, time.thread_time()
        for _ in range(3):  # no more frames: the reader must block, not spin
            got.extend(m["seq"] for m in _take(engine, 0.3))
        cpu["idle"] = time.thread_time() - c0

    threads = [threading.Thread(target=consume), threading.Thread(target=produce)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert got == list(range(1, frames + 1))  # none lost, none twice, in order
    assert engine.spin_turns > 0  # the spin did engage
    assert cpu["paced"] < frames * 2 * 0.002 + 0.2  # at most one window of spinning per frame
    assert cpu["idle"] < 0.05  # one window after the last frame, then asleep
