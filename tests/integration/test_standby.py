"""Hot standby (issue 23): kill -9 the engine in use and frames resume from the standby engine,
without waiting for a new engine to start; then a new standby is launched."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from loom_live.host_bridge import Bridge, BridgeConfig

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX signals")


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _fresh_frame(bridge: Bridge, frame: np.ndarray, timeout_s: float) -> bool:
    """Submit until latest() hands out a fresh (non-fallback) output."""
    def got() -> bool:
        bridge.submit(frame)
        return not bridge.latest()[1].fallback
    return _wait(got, timeout_s)


@pytest.mark.parametrize("engine", ["passthrough", pytest.param("embedded", marks=pytest.mark.slow)])
def test_killed_engine_is_replaced_by_the_standby_at_once(engine):
    cfg = BridgeConfig(passthrough=engine == "passthrough", engine_config="default", engine_cwd=str(ROOT),
                       standby=True, standby_start="after", heartbeat_s=0.1, hang_timeout_s=1.0,
                       stop_timeout_s=1.0, restart_backoff_s=30.0)  # a restart without the standby would wait 30 s
    frame = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with Bridge(cfg) as bridge:
        bridge.wait_running(240)
        assert _fresh_frame(bridge, frame, 240)
        assert _wait(lambda: bridge.stats()["standby"]["state"] == "ready", 240), bridge.stats()["standby"]
        active, standby = bridge.stats()["engine_pid"], bridge.stats()["standby"]["pid"]
        assert active != standby
        os.kill(active, signal.SIGKILL)
        assert _wait(lambda: bridge.stats()["engine_pid"] == standby, 10)  # switched: no restart backoff
        assert bridge.status().state == "running" and "standby" in bridge.status().message
        assert _fresh_frame(bridge, frame, 60)
        assert bridge.stats()["engine_pid"] == standby and bridge.stats()["restarts"] == 1
        # and a new standby is on its way
        assert _wait(lambda: bridge.stats()["standby"]["pid"] not in (None, active, standby), 30)
        assert bridge.stats()["standby"]["launched"] == 2


def test_a_standby_launched_with_the_engine_loads_beside_it_and_still_takes_over():
    cfg = BridgeConfig(passthrough=True, engine_config="default", engine_cwd=str(ROOT), standby=True,
                       standby_start="together", heartbeat_s=0.1, hang_timeout_s=1.0, stop_timeout_s=1.0,
                       restart_backoff_s=30.0)
    frame = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with Bridge(cfg) as bridge:
        seen_early = _wait(lambda: bridge.stats()["standby"]["pid"] is not None, 60)
        assert seen_early and bridge.status().state != "running", "the standby waited for the engine to serve"
        assert _fresh_frame(bridge, frame, 240)
        assert _wait(lambda: bridge.stats()["standby"]["state"] == "ready", 240), bridge.stats()["standby"]
        active, standby = bridge.stats()["engine_pid"], bridge.stats()["standby"]["pid"]
        os.kill(active, signal.SIGKILL)
        assert _wait(lambda: bridge.stats()["engine_pid"] == standby, 10)
        assert _fresh_frame(bridge, frame, 60)


def test_the_standby_start_is_checked():
    with pytest.raises(ValueError, match="standby_start"):
        BridgeConfig(standby=True, standby_start="later")
