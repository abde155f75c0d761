"""Hot standby (issue 23): kill -9 the engine in use and frames resume from the standby engine,
without waiting for a new engine to start; then a new standby is launched."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
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
        # said as a kill, not as an exit whose cause would be the last line the engine logged
        assert bridge.status().message.startswith("engine killed by SIGKILL"), bridge.status().message
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


def _engine_told(folder: Path) -> Path:
    """An engine Python that waits to be told what to be: a file `crash-PID` makes process PID die as a crash
    while loading does, a file `go-PID` makes it the real engine."""
    script = folder / "engine-python"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys, time
        folder, pid = {str(folder)!r}, os.getpid()
        while not os.path.exists(os.path.join(folder, f"go-{{pid}}")):
            if os.path.exists(os.path.join(folder, f"crash-{{pid}}")):
                print("CUDA out of memory while loading", flush=True)
                sys.exit(1)
            time.sleep(0.02)
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    """))
    script.chmod(0o755)
    return script


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_bridge_that_ends_dead_stops_its_standby(tmp_path):
    """The engine in use dies while the standby launched beside it still starts: the bridge is dead (an
    engine that never started is not retried) and takes no engine over, so its standby is stopped at once,
    not kept loading and holding its memory until the host closes the bridge."""
    cfg = BridgeConfig(passthrough=True, engine_python=str(_engine_told(tmp_path)), engine_cwd=str(ROOT),
                       standby=True, standby_start="together", heartbeat_s=0.1, hang_timeout_s=1.0,
                       stop_timeout_s=1.0, handshake_timeout_s=120.0)
    with Bridge(cfg) as bridge:
        assert _wait(lambda: bridge.stats()["standby"]["pid"] is not None, 60), bridge.stats()["standby"]
        active, standby = bridge.stats()["engine_pid"], bridge.stats()["standby"]["pid"]
        (tmp_path / f"crash-{active}").touch()
        with pytest.raises(RuntimeError, match="the engine could not start: .*CUDA out of memory"):
            bridge.wait_running(120)
        (tmp_path / f"go-{standby}").touch()  # a standby still running from here on would load and stay
        assert _wait(lambda: _gone(standby), 60), "the dead bridge kept its standby engine"
        assert bridge.status().state == "dead" and bridge.stats()["standby"]["state"] == "none"
