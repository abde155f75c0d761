"""A served engine that cannot use what the host offers: the host must say so, not stall behind a link that
looks alive. An engine that cannot attach a frame ring (a cuda-ipc handle it cannot open) never frees its
slots, so that engine is given up; one that cannot open the host's doorbell (it runs on another machine or
in another container) answers every hello the same way, so the run is refused once with what to change."""

from __future__ import annotations

import time

import numpy as np
import pytest

import loom_live.engine.server.core as core
from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.host_bridge import Bridge, BridgeConfig, EngineRefused, EngineState
from loom_live.host_bridge.wire.doorbell import DoorbellError
from tests.fakes.engines import InProcessEngine, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def test_an_engine_that_cannot_attach_the_hosts_ring_is_given_up_with_its_reason(monkeypatch):
    def cannot_attach(spec):  # what an engine says when a ring's handle does not open in its process
        raise RuntimeError("cudaIpcOpenMemHandle: invalid device context")

    monkeypatch.setattr(core, "attach_ring", cannot_attach)
    with InProcessEngine(PassthroughSession) as engine:
        with Bridge(BridgeConfig(transport="shm", restart_backoff_s=0.2, **engine.host)) as bridge:
            bridge.wait_running(20)
            bridge.submit(np.zeros((48, 64, 3), np.uint8))
            assert wait_until(lambda: bridge.status().state != EngineState.RUNNING, 10), bridge.status()
            assert "cudaIpcOpenMemHandle" in bridge.stats()["last_error"]
            assert bridge.status().restarts >= 1 or bridge.status().state == EngineState.RESTARTING


def test_an_engine_that_cannot_open_the_hosts_doorbell_refuses_the_run_once_saying_use_tcp(monkeypatch):
    def elsewhere(name):  # an engine on another machine: the host's /dev/shm is not its own
        raise DoorbellError(f"doorbell {name}: cannot open the segment: [Errno 2] No such file or directory")

    monkeypatch.setattr(core.Doorbell, "attach", staticmethod(elsewhere))
    with InProcessEngine(PassthroughSession) as engine:
        with Bridge(BridgeConfig(transport="shm", handshake_timeout_s=5.0, **engine.host)) as bridge:
            t0 = time.monotonic()
            with pytest.raises(EngineRefused, match=r"cannot open this host's frame lane.*use transport 'tcp'"):
                bridge.wait_running(20)
            assert time.monotonic() - t0 < 5.0  # told by the engine's answer, not by the handshake's timeout
            time.sleep(0.5)
            status = bridge.status()
            assert status.state == EngineState.DEAD and status.restarts == 0, status
