"""Stop signals during a run: the doorbell's fence, run on every frame, leaves its lock free wherever one lands."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from loom_live.host_bridge.wire import doorbell

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX stop signals")


class Landed(BaseException):
    """Stands for what a stop signal's handler raises (KeyboardInterrupt, StopRequested)."""


def test_the_fence_leaves_its_lock_free_whatever_point_a_signal_lands_on():
    """A signal raised between taking and dropping the fence's lock left it held: the next fence, of any thread,
    waited for ever, and a player stopped by SIGTERM never finished (its recording never finalised). Real signals,
    many: a CPU-time timer (pytest-timeout has the wall-clock one) raises in whatever the fence is doing."""
    armed = False

    def land(_signum, _frame):
        if armed:
            raise Landed

    previous = signal.signal(signal.SIGVTALRM, land)
    signal.setitimer(signal.ITIMER_VIRTUAL, 0.0002, 0.0002)
    landed = held = 0
    deadline = time.monotonic() + 10
    try:
        while landed < 300 and time.monotonic() < deadline:
            try:
                armed = True
                while True:
                    doorbell._fence()
            except Landed:
                armed = False
                landed += 1
            if doorbell._fence_lock.locked():
                held += 1
                doorbell._fence_lock.release()
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, previous)
    assert landed >= 20, f"only {landed} signals landed in 10 s"
    assert held == 0, f"{held} of {landed} signals left the fence's lock held"
