"""Stop signals during a run: raised at once in the player's code, held back (and the bridge's wait ended) while the
main thread is inside the bridge, whose locks an exception from outside can leave held; the doorbell's fence,
run on every frame, leaves its lock free whatever instruction an exception lands on."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from loom_live.host_bridge import Bridge, Interrupted
from loom_live.host_bridge.wire import doorbell
from loom_live.host_bridge.wire.channel import read_secret_file
from loom_live.plugin.media.stop_signals import DEFERRED_SIGNALS
from loom_live.plugin.player.stop_requests import StopRequested, StopSignals, stop_outcome

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


def _in_module(name: str, body: str) -> dict:
    """Run `body` as code of module `name` (the bridge's, the player's): what a signal handler sees as the frame
    it interrupted."""
    scope = {"__name__": name, "signal": signal, "sys": sys}
    exec(compile(body, f"<{name}>", "exec"), scope)
    return scope


@pytest.fixture
def stops():
    """Installed over default handlers (a test process started in the background may ignore Ctrl-C)."""
    interrupts: list[int] = []
    stops = StopSignals(lambda: interrupts.append(1))
    stops.interrupts = interrupts
    previous = {signum: signal.signal(signum, signal.SIG_DFL) for signum in DEFERRED_SIGNALS}
    stops.install()
    yield stops
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_a_stop_inside_the_bridge_is_held_and_ends_the_bridges_wait(stops):
    _in_module("loom_live.host_bridge.client", "signal.raise_signal(signal.SIGTERM)")  # no exception inside
    assert stops.interrupts == [1], "the bridge's wait was not ended"
    with pytest.raises(StopRequested) as stop:
        stops.check()
    assert stop.value.signum == signal.SIGTERM


def test_a_stop_in_the_players_code_is_raised_at_once_even_when_the_bridge_called_it(stops):
    """The frames the bridge pulls from the player's generator: raised there, it reaches the bridge as that
    generator's exception, at a point made for one."""
    scope = _in_module("loom_live.host_bridge.client", "def pull(frames):\n    return next(frames)\n")
    player = _in_module("loom_live.plugin.player.app", "def frames():\n    signal.raise_signal(signal.SIGINT)\n"
                                                      "    yield 1\n")
    with pytest.raises(KeyboardInterrupt):
        scope["pull"](player["frames"]())
    assert stops.interrupts == []


def test_a_stop_that_a_library_swallowed_still_ends_the_run(stops):
    """Raised inside a library's bare `except` (or a finaliser, whose exceptions Python only prints): the run's
    next check raises it again."""
    _in_module("loom_live.plugin.media.sources", "try:\n    signal.raise_signal(signal.SIGHUP)\nexcept BaseException:\n"
                                                 "    pass\n")
    with pytest.raises(StopRequested) as stop:
        stops.check()
    assert stop.value.signum == signal.SIGHUP


def test_a_signal_the_run_was_started_ignoring_stays_ignored():
    """`nohup loom play ...`: a closed terminal's SIGHUP must not stop the show."""
    previous = {signal.SIGHUP: signal.signal(signal.SIGHUP, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, signal.SIG_DFL)}
    try:
        installed = StopSignals(lambda: None).install()
        try:
            assert signal.SIGHUP not in installed and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.SIGTERM in installed
        finally:
            for signum, handler in installed.items():
                signal.signal(signum, handler)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def test_a_stop_is_said_and_exits_as_a_shell_reports_it():
    assert stop_outcome(KeyboardInterrupt(), None) == ("Ctrl-C", 130)
    assert stop_outcome(StopRequested(signal.SIGTERM), None) == ("SIGTERM", 143)
    assert stop_outcome(Interrupted(), signal.SIGHUP) == ("SIGHUP", 129)


def test_interrupt_ends_a_wait_for_an_engine_that_never_comes(tmp_path):
    """A served engine that is not there: wait_running would wait its whole timeout; interrupt() ends it."""
    secret = str(tmp_path / "secret")
    read_secret_file(secret, create=True)
    bridge = Bridge(launch=False, endpoint=f"ipc://{tmp_path / 'nobody'}", secret_file=secret)
    try:
        bridge.start()
        threading.Timer(0.2, bridge.interrupt).start()
        started = time.monotonic()
        with pytest.raises(Interrupted):
            bridge.wait_running(120)
        assert time.monotonic() - started < 60, "the wait went on after interrupt()"
    finally:
        bridge.close()
