"""The supervisor adopts a standby engine only while it is itself alive (its process running, heard from within
hang_timeout_s); one that died or went silent since its last check is closed and the engine restarts as
without a standby. An engine in use that died before its first ready waits for a loading standby only as long
as that one's own timeouts allow; a standby that fails too (while waited for, or before) ends the bridge with both
engines' last lines, and one that refused its run ends it as a refusal. Fakes stand in for the links and their
processes; liveness, refusals and the lines kept are read by `Link`'s own code."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from loom_live.host_bridge import BridgeConfig, EngineState
from loom_live.host_bridge.launcher import LOG_TAIL_SHOWN
from loom_live.host_bridge.link import Link
from loom_live.host_bridge.supervisor import Supervisor


class _Proc:
    def __init__(self, alive: bool, pid: int) -> None:
        self.alive, self.pid = alive, pid
        self.lines: list[str] = []
        self.refused: str | None = None  # the engine's own error, once it exited refusing its run

    def ending(self) -> str:
        return "engine exited with code 2" if self.refused else "engine killed by SIGKILL"

    def refusal(self) -> str | None:
        return self.refused

    def log_tail(self) -> list[str]:
        return self.lines[-LOG_TAIL_SHOWN:]


class _Channel:
    handshake_refusal = None

    def poll(self, timeout_s: float) -> list:
        return []


class _RunningLink:
    """A ready engine's link as far as the supervisor and the standby read it; stopping it is only noted."""

    ready = Link.ready
    check = Link.check
    heard = Link.heard
    credentials_refused = Link.credentials_refused
    refusal = Link.refusal
    log_tail = Link.log_tail
    lane_refused = None

    def __init__(self, cfg: BridgeConfig, alive: bool = True, silent_s: float = 0.0, phase: str = "running",
                 load_deadline: float = float("inf"), pid: int = 4242) -> None:
        self.cfg, self.proc, self.channel = cfg, _Proc(alive, pid), _Channel()
        self.phase, self.load_deadline = phase, load_deadline
        self.last_heard = time.monotonic() - silent_s
        self.stopped = threading.Event()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def maybe_heartbeat(self, now: float) -> None:
        pass  # nothing travels: no engine listens

    def teardown(self, reason: str, timeout_s: float) -> None:
        self.stopped.set()


@pytest.fixture
def supervisor():
    cfg = BridgeConfig(standby=True, hang_timeout_s=1.0, restart_backoff_s=30.0)
    ctx = zmq.Context()
    yield Supervisor(cfg, ctx)
    ctx.term()


@pytest.mark.parametrize(("standby_kw", "said"), [
    ({"alive": False}, "engine killed by SIGKILL"),
    ({"silent_s": 30.0}, "engine silent for "),
], ids=["exited", "silent"])
def test_a_standby_that_died_since_its_last_check_is_closed_not_adopted(supervisor, standby_kw, said):
    """Taken because it was ready at its last check, it became the engine in use with its silence forgotten,
    and the show waited for that to be found out before a restart."""
    cfg = supervisor.config
    active, standby = _RunningLink(cfg, alive=False), _RunningLink(cfg, **standby_kw)
    supervisor.link, supervisor.standby.link = active, standby
    supervisor._fail(active, "engine killed by SIGKILL")
    assert supervisor.link is None and supervisor.standby.link is None
    assert standby.stopped.wait(30) and active.stopped.is_set()
    assert supervisor.state == EngineState.RESTARTING and supervisor.restarts == 1
    assert supervisor.message == "engine killed by SIGKILL; restarting in 30.0 s", supervisor.message
    assert supervisor.standby.problem.startswith(said), supervisor.standby.problem


def test_a_live_standby_is_adopted_at_once(supervisor):
    cfg = supervisor.config
    active, standby = _RunningLink(cfg, alive=False), _RunningLink(cfg, silent_s=0.5)
    supervisor.link, supervisor.standby.link = active, standby
    supervisor._fail(active, "engine killed by SIGKILL")
    assert active.stopped.wait(30) and not standby.stopped.is_set()
    assert supervisor.link is standby and supervisor.standby.link is None
    assert supervisor.state == EngineState.RUNNING and "switched to the standby engine" in supervisor.message


def test_a_standby_past_its_load_timeout_ends_the_wait_naming_both_causes(supervisor, caplog):
    """The engine in use exited while loading; the standby loading beside it is waited for, but not beyond
    its own load timeout: then the bridge is dead, and says why each engine did not start."""
    cfg = supervisor.config
    active = _RunningLink(cfg, alive=False, phase="loading")
    standby = _RunningLink(cfg, phase="loading", load_deadline=time.monotonic() + 3600)
    supervisor.link, supervisor.standby.link = active, standby
    supervisor._fail(active, "engine killed by SIGKILL")
    assert supervisor.state == EngineState.STARTING and supervisor.link is None and active.stopped.is_set()
    assert supervisor.message == "the engine could not start: engine killed by SIGKILL; waiting for the standby " \
                                 "engine (pid 4242) to finish loading", supervisor.message
    supervisor._step()  # loading within its timeout: still waited for, no new engine launched
    assert supervisor.state == EngineState.STARTING and supervisor.link is None
    assert supervisor.standby.link is standby
    standby.load_deadline = time.monotonic() - 1
    with caplog.at_level("ERROR", logger="loom_live.host_bridge.supervisor"):
        supervisor._step()
    assert standby.stopped.wait(30)
    said = "the engine could not start: engine killed by SIGKILL; the standby engine could not start either: " \
           "engine not ready within 900 s"
    assert supervisor.state == EngineState.DEAD and supervisor.message == said, supervisor.message
    assert said in caplog.text


def test_an_engine_after_a_standby_that_took_over_a_failed_start_is_restarted_when_it_dies_loading(supervisor):
    """The first engine died loading and the standby beside it took over: an engine of this bridge has been
    ready, so a later engine that dies while loading is restarted; the bridge ended dead, as for a first start
    that failed (taking the standby did not count as a ready engine)."""
    cfg = supervisor.config
    active = _RunningLink(cfg, alive=False, phase="loading")
    standby = _RunningLink(cfg, phase="loading", pid=4243)
    supervisor.link, supervisor.standby.link = active, standby
    supervisor._fail(active, "engine killed by SIGKILL")
    standby.phase = "running"
    with supervisor.cond:
        assert supervisor._adopt_standby("engine restarted from the standby")
    assert supervisor.link is standby and supervisor.state == EngineState.RUNNING
    later = _RunningLink(cfg, alive=False, phase="loading", pid=4244)
    supervisor.link = later
    supervisor._fail(later, "engine killed by SIGKILL")
    assert later.stopped.wait(30)
    assert supervisor.state == EngineState.RESTARTING, supervisor.message

def _both_loading(supervisor: Supervisor, active_lines: tuple[str, ...] = ()) -> tuple[_RunningLink, _RunningLink]:
    """The engine in use exited while loading (having printed `active_lines`) and the bridge waits for the
    standby loading beside it."""
    cfg = supervisor.config
    active = _RunningLink(cfg, alive=False, phase="loading", pid=4241)
    active.proc.lines = list(active_lines)
    standby = _RunningLink(cfg, phase="loading")
    supervisor.link, supervisor.standby.link = active, standby
    supervisor._fail(active, "engine killed by SIGKILL")
    assert supervisor.state == EngineState.STARTING and supervisor.standby.link is standby, supervisor.message
    return active, standby


def test_a_standby_that_refuses_its_run_while_waited_for_ends_the_bridge_as_a_refusal(supervisor):
    """As the engine in use's refusal does: `refusal` (what hosts raise EngineRefused with) is the standby's own
    error, and the message says it once, after why the engine in use did not start."""
    _, standby = _both_loading(supervisor)
    standby.proc.alive, standby.proc.refused = False, "no weights at /missing"
    supervisor._step()
    assert standby.stopped.wait(30)
    assert supervisor.state == EngineState.DEAD and supervisor.refusal == "no weights at /missing"
    assert supervisor.last_error == "no weights at /missing"
    assert supervisor.message == "the engine could not start: engine killed by SIGKILL; the standby engine refused " \
                                 "to start: no weights at /missing", supervisor.message


def test_a_standby_that_crashes_too_is_no_refusal(supervisor):
    _, standby = _both_loading(supervisor)
    standby.proc.alive = False
    supervisor._step()
    assert supervisor.state == EngineState.DEAD and supervisor.refusal == ""
    assert supervisor.message.endswith("the standby engine could not start either: engine killed by SIGKILL")


def _standby_failed_first(supervisor: Supervisor, refused: str | None = None) -> tuple[_RunningLink, _RunningLink]:
    """Both engines load side by side; the standby fails first (refusing its run with `refused`, else crashing)
    and is given up, with the next one not due for 30 s; the engine in use loads on. Each printed a line."""
    cfg = supervisor.config
    active, standby = _RunningLink(cfg, phase="loading", pid=4241), _RunningLink(cfg, alive=False, phase="loading")
    active.proc.lines, standby.proc.lines, standby.proc.refused = ["engine line"], ["standby line"], refused
    supervisor.link, supervisor.standby.link = active, standby
    supervisor._step()
    assert supervisor.standby.link is None and supervisor.link is active and supervisor.standby.failures == 1
    return active, standby


def test_an_engine_dead_before_its_first_ready_after_its_standby_failed_names_both_causes(supervisor):
    """With no standby left to wait for, the bridge ended naming only the engine in use's cause: the standby's
    earlier failure was never said. Now it ends as when the standby fails while waited for."""
    active, _ = _standby_failed_first(supervisor)
    active.proc.alive = False
    supervisor._step()
    assert active.stopped.is_set()
    assert supervisor.state == EngineState.DEAD and supervisor.refusal == ""
    assert supervisor.message == "the engine could not start: engine killed by SIGKILL; the standby engine could not " \
                                 "start either: engine killed by SIGKILL", supervisor.message
    assert supervisor.log_tail == ["[engine pid 4241] engine line", "[standby engine pid 4242] standby line"]


def test_a_standby_that_refused_its_run_before_the_engine_in_use_died_ends_the_bridge_as_a_refusal(supervisor):
    """The same run's settings would be refused by either engine: the host gets the standby's own error
    (EngineRefused), as when the standby refuses while waited for, whichever engine went first."""
    active, _ = _standby_failed_first(supervisor, refused="no weights at /missing")
    active.proc.alive = False
    supervisor._step()
    assert supervisor.state == EngineState.DEAD and supervisor.refusal == "no weights at /missing"
    assert supervisor.last_error == "no weights at /missing"
    assert supervisor.message == "the engine could not start: engine killed by SIGKILL; the standby engine refused " \
                                 "to start: no weights at /missing", supervisor.message


def test_a_standby_failure_followed_by_a_ready_standby_is_not_named_when_the_bridge_ends():
    """The first standby failed; the next one was ready, took over, and died with restarts off: the bridge ends
    with that engine's cause alone, not the failure from before it was ready."""
    cfg = BridgeConfig(standby=True, restart=False, hang_timeout_s=1.0, restart_backoff_s=30.0)
    ctx = zmq.Context()
    try:
        supervisor = Supervisor(cfg, ctx)
        active, _ = _standby_failed_first(supervisor)
        ready = _RunningLink(cfg, phase="loading")
        ready.hello_done, ready.on_ready = True, lambda info: setattr(ready, "phase", "running")
        ready.proc.lines = ["took over"]
        supervisor.standby.link = ready
        supervisor.standby._handle(ready, {"type": "ready", "info": {}})
        active.proc.alive = False
        supervisor._step()
        assert supervisor.link is ready and supervisor.state == EngineState.RUNNING, supervisor.message
        ready.proc.alive = False
        supervisor._step()
        assert supervisor.state == EngineState.DEAD and supervisor.message == "engine killed by SIGKILL"
        assert supervisor.log_tail == ["took over"]
    finally:
        ctx.term()


@pytest.mark.parametrize(("engine_lines", "standby_lines", "kept"), [
    (12, 12, (5, 5)),  # each keeps half of the bound
    (2, 12, (2, 8)),  # what one does not use is the other's
    (12, 1, (9, 1)),
    (0, 3, (0, 3)),
])
def test_both_engines_last_lines_share_the_log_tail_each_named(supervisor, engine_lines, standby_lines, kept):
    _, standby = _both_loading(supervisor, tuple(f"engine line {i}" for i in range(engine_lines)))
    standby.proc.lines = [f"standby line {i}" for i in range(standby_lines)]
    standby.proc.alive = False
    supervisor._step()
    assert supervisor.state == EngineState.DEAD
    expected = [f"[engine pid 4241] engine line {i}" for i in range(engine_lines - kept[0], engine_lines)] + \
               [f"[standby engine pid 4242] standby line {i}" for i in range(standby_lines - kept[1], standby_lines)]
    assert supervisor.log_tail == expected


def test_a_standby_that_keeps_failing_is_tried_less_often_and_at_once_again_after_one_was_ready():
    """Each standby that cannot load (no room on the GPU, weights gone) was followed by the next 2 s later, a
    model load on the machine every few seconds for the rest of the show; now the wait doubles up to a minute,
    and a standby that became ready starts the count again."""
    import itertools

    from loom_live.host_bridge.standby import RETRY_MAX_S, Standby

    cfg = BridgeConfig(standby=True, restart_backoff_s=0.5, restart_backoff_max_s=10.0)
    ctx = zmq.Context()
    try:
        standby = Standby(cfg, ctx, threading.RLock(), itertools.count())

        def fail_one() -> float:
            delay = standby.retry_delay()
            standby.link = _RunningLink(cfg, alive=False, phase="loading")
            standby.step(open_new=True)  # its process is gone: given up, the next one planned
            assert standby.link is None and 0.0 < standby._next_open - time.monotonic() <= delay
            return delay

        assert [fail_one() for _ in range(7)] == [2.0, 4.0, 8.0, 16.0, 32.0, RETRY_MAX_S, RETRY_MAX_S]
        assert standby.describe()["failures"] == 7
        ready = _RunningLink(cfg, phase="loading")
        ready.hello_done, ready.on_ready = True, lambda info: setattr(ready, "phase", "running")
        standby.link = ready
        standby._handle(ready, {"type": "ready", "info": {}})
        assert standby.ready and standby.failures == 0
        assert fail_one() == 2.0
    finally:
        ctx.term()
