"""The doorbell's wake path: a waiting side sleeps in the kernel and the writer wakes it.

What a host and an engine rely on: a waiter in one process is woken by a record another process
publishes (not by its timeout); a wait with nothing coming still returns at its timeout; writing
while nobody waits makes no wake call and leaves no wake behind for the next wait; and under a race
(the writer publishing just as the reader goes to sleep, many times over, or `wake()` from another
thread just as it does) no wake-up is lost. A lost one would show as a wait that runs to its (long)
timeout, which these tests count instead of timing anything.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from loom_live.host_bridge.wire import doorbell as db
from loom_live.host_bridge.wire.doorbell import Doorbell
from loom_live.host_bridge.wire.shared_wait import backend, shared_wait

ROOT = Path(__file__).resolve().parents[2]
LONG_S = 20.0  # a wait this long only ends early when woken: reaching it means a lost wake-up
kernel_wait = pytest.mark.skipif(backend() == "poll", reason="no kernel wait on this platform (the doorbell polls)")

WRITER = textwrap.dedent("""
    import random, sys, time
    from loom_live.host_bridge.wire.doorbell import Doorbell
    side = Doorbell.attach(sys.argv[1])
    count, mode = int(sys.argv[2]), sys.argv[3]
    if mode == "late":
        sys.stdin.readline()  # the reader is waiting by now
        time.sleep(0.2)
    rng, timeouts = random.Random(7), 0
    with side.lock:
        for seq in range(1, count + 1):
            if mode == "race":  # land on every phase of the reader's way to sleep
                time.sleep(rng.choice((0.0, 0.0, 0.00002, 0.00005, 0.0001, 0.0003)))
            side.send_frame(seq % 3, seq, 1)
            if mode == "race" and not side.receive(float(sys.argv[4])):  # the reader's answer
                timeouts += 1
                break
    print(side.wakes, timeouts, flush=True)
    side.close()
""")


@pytest.fixture
def pair():
    host = Doorbell.create()
    engine = Doorbell.attach(host.name)
    yield host, engine
    engine.close()
    host.close()


def _writer(name: str, count: int, mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", WRITER, name, str(count), mode, str(LONG_S)], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


@kernel_wait
def test_a_waiter_is_woken_by_a_writer_in_another_process(pair):
    host, _ = pair
    writer = _writer(host.name, 1, "late")
    try:
        with host.lock:
            sleeps = host.sleeps
            writer.stdin.write("go\n")
            writer.stdin.flush()
            c0, t0 = time.thread_time(), time.monotonic()
            got = host.receive(LONG_S)
            waited, cpu = time.monotonic() - t0, time.thread_time() - c0
        assert [(m["type"], m["seq"]) for m, _ in got] == [("frame", 1)]
        assert waited < LONG_S / 2  # woken, not timed out
        assert host.sleeps > sleeps and cpu < waited / 2  # it slept in the kernel meanwhile, not polled
        assert int(writer.stdout.readline().split()[0]) >= 1  # the writer saw it asleep and made the wake call
    finally:
        writer.wait(10)


def test_a_wait_with_nothing_coming_returns_at_its_timeout(pair):
    host, _ = pair
    with host.lock:
        t0 = time.monotonic()
        assert host.receive(0.2) == []
        assert time.monotonic() - t0 >= 0.19


def test_writes_with_no_waiter_make_no_wake_call_and_leave_no_wake_behind(pair):
    host, engine = pair
    for seq in range(40):
        assert host.send_frame(seq % 3, seq, 1)
    if db.FENCE_ORDERS:
        assert host.wakes == 0  # nobody asleep: no system call
    with engine.lock:
        assert [m["seq"] for m, _ in engine.receive(1.0)] == list(range(40))
        t0 = time.monotonic()
        assert engine.receive(0.2) == []  # nothing new: the earlier writes do not end this wait early
        assert time.monotonic() - t0 >= 0.19


@kernel_wait
def test_no_wake_up_is_lost_under_a_race_of_many_quick_writes(pair):
    """Ping-pong with random gaps: each notice is the only one until it is answered, so a wake-up lost
    on either side leaves that side asleep until its timeout."""
    host, _ = pair
    count = 2000
    writer = _writer(host.name, count, "race")
    rng = random.Random(11)
    seqs, timeouts = [], 0
    try:
        with host.lock:
            while len(seqs) < count and timeouts == 0:
                got = host.receive(LONG_S)
                timeouts += not got
                for msg, _ in got:
                    seqs.append(msg["seq"])
                    time.sleep(rng.choice((0.0, 0.0, 0.00002, 0.00005, 0.0001, 0.0003)))
                    host.send_release(msg["slot"], msg["gen"])
        assert timeouts == 0, f"the reader slept through a notice (after {len(seqs)} of {count})"
        wakes, writer_timeouts = map(int, writer.stdout.readline().split())
        assert writer_timeouts == 0, "the writer slept through an answer"
        assert seqs == list(range(1, count + 1)) and host.refused == 0
        assert host.sleeps > 0 and host.wakes > 0 and wakes > 0  # both sides did sleep and get woken
    finally:
        writer.kill()
        writer.wait(10)


def test_wake_from_another_thread_always_ends_the_wait(pair):
    host, _ = pair
    rng = random.Random(3)
    ended: list[bool] = []
    for _ in range(100):
        waiter = threading.Thread(target=_receive_once, args=(host, ended), daemon=True)
        waiter.start()
        time.sleep(rng.choice((0.0, 0.00005, 0.0002, 0.001)))  # before, during or after it goes to sleep
        host.wake()
        waiter.join(LONG_S / 2)
        assert not waiter.is_alive(), "a wake() was lost: the wait ran on"
    assert ended == [True] * 100


@kernel_wait
def test_wake_reaches_a_waiter_that_lost_the_cpu_on_its_way_into_the_kernel(pair):
    """The worst case, made certain: wake() lands after the waiter's last look, before its sleep."""
    host, _ = pair
    host._in_wait = Descheduled(host._in_wait)
    ended: list[bool] = []
    waiter = threading.Thread(target=_receive_once, args=(host, ended), daemon=True)
    waiter.start()
    while not host._asleep:  # it has looked, and is on its way to sleep
        time.sleep(0.0005)
    host.wake()
    waiter.join(LONG_S / 2)
    assert not waiter.is_alive() and ended == [True], "a wake() was lost: the wait ran on"


class Descheduled:
    """A kernel wait whose thread is preempted for a moment just before it enters the kernel."""

    def __init__(self, inner):
        self.inner, self.sticky = inner, inner.sticky

    def wait(self, expected: int, timeout_s: float) -> None:
        time.sleep(0.05)
        self.inner.wait(expected, timeout_s)

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()


def _receive_once(side: Doorbell, ended: list) -> None:
    with side.lock:
        ended.append(side.receive(LONG_S) == [])


@kernel_wait
def test_the_kernel_wait_returns_at_once_when_the_word_already_changed():
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(create=True, size=64)
    try:
        waiter = shared_wait(shm.buf, 0, f"loom_test_{os.getpid()}", create=True)
        if waiter.sticky:
            waiter.close()
            pytest.skip("an event does not watch the word")
        t0 = time.monotonic()
        waiter.wait(1, LONG_S)  # the word holds 0, not 1: a futex or ulock does not sleep
        assert time.monotonic() - t0 < LONG_S / 2
        waiter.wake()  # nobody sleeping: harmless
        waiter.close()
    finally:
        shm.close()
        shm.unlink()


def test_without_a_kernel_wait_the_doorbell_polls_and_keeps_its_promises(monkeypatch):
    """The portable fallback (no futex, ulock or event): notices, timeouts and wake() as before."""
    monkeypatch.setattr(db, "shared_wait", lambda *args, **kwargs: None)
    host = Doorbell.create()
    engine = Doorbell.attach(host.name)
    try:
        threading.Timer(0.05, lambda: host.send_frame(1, 5, 1)).start()
        with engine.lock:
            assert [m["seq"] for m, _ in engine.receive(LONG_S)] == [5]
            t0 = time.monotonic()
            assert engine.receive(0.2) == [] and time.monotonic() - t0 >= 0.19
        threading.Timer(0.05, engine.wake).start()
        with engine.lock:
            t0 = time.monotonic()
            assert engine.receive(LONG_S) == [] and time.monotonic() - t0 < LONG_S / 2
        assert engine.sleeps == 0 and host.wakes == 0  # nothing slept in the kernel, nothing was woken
    finally:
        engine.close()
        host.close()
