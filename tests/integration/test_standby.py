"""Hot standby (issue 23): kill -9 the engine in use and frames resume from the standby engine,
without waiting for a new engine to start; then a new standby is launched. An engine in use that dies
before its first ready hands over to a standby launched beside it once that one is ready; if that one fails too,
the bridge ends dead with both engines' last lines, as a refusal when the standby refused its run (also when the
standby failed first, with nothing left to wait for)."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from loom_live.host_bridge import Bridge, BridgeConfig
from loom_live.host_bridge.client import EngineRefused
from loom_live.host_bridge.wire.errors import SERVE_ERROR_PREFIX

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
    while loading does, `refuse-PID` makes it refuse its run as the engine does (exit code 2), a file `go-PID`
    makes it the real engine."""
    script = folder / "engine-python"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys, time
        folder, pid = {str(folder)!r}, os.getpid()
        while not os.path.exists(os.path.join(folder, f"go-{{pid}}")):
            if os.path.exists(os.path.join(folder, f"crash-{{pid}}")):
                print("CUDA out of memory while loading", flush=True)
                sys.exit(1)
            if os.path.exists(os.path.join(folder, f"refuse-{{pid}}")):
                print({SERVE_ERROR_PREFIX!r} + "no weights at /missing", file=sys.stderr, flush=True)
                sys.exit(2)
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


def _told_config(folder: Path) -> BridgeConfig:
    """Both engines launched together by `_engine_told`, neither given a handshake deadline a loaded machine
    could reach: each one starts, crashes or refuses only when the test says so."""
    return BridgeConfig(passthrough=True, engine_python=str(_engine_told(folder)), engine_cwd=str(ROOT),
                        standby=True, standby_start="together", heartbeat_s=0.1, hang_timeout_s=1.0,
                        stop_timeout_s=1.0, handshake_timeout_s=120.0)


def _both_launched(bridge: Bridge) -> tuple[int, int]:
    """The engine in use and the standby launched beside it, once both are."""
    assert _wait(lambda: bridge.stats()["standby"]["pid"] is not None, 60), bridge.stats()["standby"]
    return bridge.stats()["engine_pid"], bridge.stats()["standby"]["pid"]


def _waits_for(bridge: Bridge, standby: int) -> bool:
    """The bridge says it waits for that standby (False at once if it ended instead)."""
    said = f"waiting for the standby engine (pid {standby})"
    _wait(lambda: said in bridge.status().message or bridge.status().state.ended, 60)
    return said in bridge.status().message


def test_an_engine_dead_before_its_first_ready_hands_over_to_the_standby_loading_beside_it(tmp_path, caplog):
    """The first engine's load runs out of memory while the standby still loads: the bridge keeps starting,
    says why, and takes the standby once it is ready, instead of ending dead."""
    caplog.set_level("WARNING", logger="loom_live.host_bridge.supervisor")
    frame = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    with Bridge(_told_config(tmp_path)) as bridge:
        active, standby = _both_launched(bridge)
        (tmp_path / f"crash-{active}").touch()
        assert _waits_for(bridge, standby), bridge.status().message
        status = bridge.status()
        assert status.state == "starting" and "CUDA out of memory" in status.message, status
        assert any("waiting for the standby engine" in r.getMessage() and r.levelname == "WARNING"
                   for r in caplog.records), caplog.text
        (tmp_path / f"go-{standby}").touch()
        bridge.wait_running(120)
        assert bridge.stats()["engine_pid"] == standby
        assert bridge.status().message.startswith("the engine could not start: engine exited with code 1: CUDA out "
                                                  "of memory while loading; the standby engine took over"), \
            bridge.status().message
        assert _fresh_frame(bridge, frame, 60)


def _standby_waited_for_then(bridge: Bridge, tmp_path, end: str) -> tuple[int, int]:
    """The engine in use crashes while loading, the bridge waits for the standby, which then ends as `end` says
    (the fake engine's crash-PID or refuse-PID file); the two pids."""
    active, standby = _both_launched(bridge)
    (tmp_path / f"crash-{active}").touch()
    assert _waits_for(bridge, standby), bridge.status().message
    (tmp_path / f"{end}-{standby}").touch()
    return active, standby


def test_a_standby_that_dies_too_ends_the_bridge_naming_both_causes(tmp_path):
    with Bridge(_told_config(tmp_path)) as bridge:
        active, standby = _standby_waited_for_then(bridge, tmp_path, "crash")
        with pytest.raises(RuntimeError) as failed:
            bridge.wait_running(120)
        crash = "engine exited with code 1: CUDA out of memory while loading"
        said = f"the engine could not start: {crash}; the standby engine could not start either: {crash}"
        assert said in str(failed.value), str(failed.value)
        status = bridge.status()
        assert status.state == "dead" and status.message == said and status.refusal == ""
        # each engine's last line, named: the host sees what both said, not only the first
        assert status.log_tail == [f"[engine pid {active}] CUDA out of memory while loading",
                                   f"[standby engine pid {standby}] CUDA out of memory while loading"], status.log_tail


def test_a_standby_that_refuses_its_run_while_waited_for_ends_the_bridge_as_a_refusal(tmp_path):
    """As when the engine in use refuses it: EngineRefused with the engine's own error, said once."""
    with Bridge(_told_config(tmp_path)) as bridge:
        _, standby = _standby_waited_for_then(bridge, tmp_path, "refuse")
        with pytest.raises(EngineRefused) as refused:
            bridge.wait_running(120)
        assert str(refused.value) == "no weights at /missing"
        status = bridge.status()
        assert status.state == "dead" and status.refusal == "no weights at /missing"
        assert status.message == "the engine could not start: engine exited with code 1: CUDA out of memory while " \
                                 "loading; the standby engine refused to start: no weights at /missing", status.message
        assert f"[standby engine pid {standby}] {SERVE_ERROR_PREFIX}no weights at /missing" in status.log_tail


def test_a_standby_that_refused_before_the_engine_in_use_died_ends_the_bridge_as_a_refusal(tmp_path):
    """The other order: the standby refuses its run first, then the engine in use crashes while loading with no
    standby left to wait for. The bridge said only the crash; now it ends as when the standby refuses later."""
    cfg = dataclasses.replace(_told_config(tmp_path), restart_backoff_s=60.0)  # no next standby meanwhile
    with Bridge(cfg) as bridge:
        active, standby = _both_launched(bridge)
        (tmp_path / f"refuse-{standby}").touch()
        assert _wait(lambda: bridge.stats()["standby"]["failures"] == 1, 60), bridge.stats()["standby"]
        (tmp_path / f"crash-{active}").touch()
        with pytest.raises(EngineRefused, match="no weights at /missing"):
            bridge.wait_running(120)
        status = bridge.status()
        assert status.message == "the engine could not start: engine exited with code 1: CUDA out of memory while " \
                                 "loading; the standby engine refused to start: no weights at /missing", status.message
        assert status.log_tail == [f"[engine pid {active}] CUDA out of memory while loading",
                                   f"[standby engine pid {standby}] {SERVE_ERROR_PREFIX}no weights at /missing"], \
            status.log_tail


def test_a_bridge_that_ends_dead_stops_its_standby(tmp_path):
    """The engine in use refuses its run while the standby launched beside it still starts: the bridge is dead
    (the standby would refuse the same run) and takes no engine over, so its standby is stopped at once, not
    kept loading and holding its memory until the host closes the bridge."""
    with Bridge(_told_config(tmp_path)) as bridge:
        active, standby = _both_launched(bridge)
        (tmp_path / f"refuse-{active}").touch()
        with pytest.raises(EngineRefused, match="no weights at /missing"):
            bridge.wait_running(120)
        (tmp_path / f"go-{standby}").touch()  # a standby still running from here on would load and stay
        assert _wait(lambda: _gone(standby), 60), "the dead bridge kept its standby engine"
        assert bridge.status().state == "dead" and bridge.stats()["standby"]["state"] == "none"
