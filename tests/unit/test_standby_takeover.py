"""The supervisor adopts a standby engine only while it is itself alive (its process running, heard from within
hang_timeout_s); one that died or went silent since its last check is closed and the engine restarts as
without a standby. An engine in use that died before its first ready waits for a loading standby only as long
as that one's own timeouts allow. Fakes stand in for the links; their liveness is judged by `Link`'s own code."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from loom_live.host_bridge import BridgeConfig, EngineState
from loom_live.host_bridge.link import Link
from loom_live.host_bridge.supervisor import Supervisor


class _Proc:
    def __init__(self, alive: bool) -> None:
        self.alive = alive
        self.pid = 4242

    def ending(self) -> str:
        return "engine killed by SIGKILL"


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

    def __init__(self, cfg: BridgeConfig, alive: bool = True, silent_s: float = 0.0, phase: str = "running",
                 load_deadline: float = float("inf")) -> None:
        self.cfg, self.proc, self.channel = cfg, _Proc(alive), _Channel()
        self.phase, self.load_deadline = phase, load_deadline
        self.last_heard = time.monotonic() - silent_s
        self.stopped = threading.Event()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self) -> list[str]:
        return []

    def refusal(self) -> str | None:
        return None

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
