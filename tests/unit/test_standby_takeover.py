"""The supervisor adopts a standby engine only while it is itself alive (its process running, heard from within
hang_timeout_s); one that died or went silent since its last check is closed and the engine restarts as
without a standby. Fakes stand in for the links; their liveness is judged by `Link`'s own code."""

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


class _RunningLink:
    """A ready engine's link as far as the supervisor and the standby read it; stopping it is only noted."""

    ready = Link.ready
    check = Link.check
    heard = Link.heard
    credentials_refused = Link.credentials_refused

    def __init__(self, cfg: BridgeConfig, alive: bool = True, silent_s: float = 0.0) -> None:
        self.cfg, self.proc, self.channel = cfg, _Proc(alive), _Channel()
        self.phase, self.load_deadline = "running", float("inf")
        self.last_heard = time.monotonic() - silent_s
        self.stopped = threading.Event()

    def log_tail(self) -> list[str]:
        return []

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
