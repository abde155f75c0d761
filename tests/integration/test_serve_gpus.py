"""`loom serve --gpus 2` behind a real Bridge: the host sees one engine whose DiT runs over two
ranks (CPU processes here). A clip streams end to end in order, a step change is taken live, and
a killed rank ends that engine, which the host reports and replaces while showing its fallback."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from loom_live.host_bridge import Bridge, BridgeConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = ["resolution.width=32", "resolution.height=32", "stream.steps=[700]", "model.dtype=float32"]

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc").is_dir() or not Path("/dev/shm").is_dir(),
                                                   reason="needs /proc and POSIX shared memory")]


def _frames(n: int, start: int = 0) -> list[np.ndarray]:
    """Wider than the model's frame: the crop policy passes the side bands through, so each
    output carries the identity of its input."""
    out = []
    for i in range(start, start + n):
        f = np.random.default_rng(i).integers(0, 256, (32, 48, 3), dtype=np.uint8)
        f[:, :8] = i
        out.append(f)
    return out


def _rank_pids(engine_pid: int) -> list[int]:
    """The engine's pipeline ranks: its children started by multiprocessing's spawn."""
    pids = []
    for task in Path(f"/proc/{engine_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(int(child))
    return pids


def _wait(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_serve_gpus_2_streams_a_clip_and_a_killed_rank_is_replaced():
    cfg = BridgeConfig(passthrough=False, engine_cwd=str(ROOT), engine_overrides=TINY, engine_args=["--gpus", "2"],
                       heartbeat_s=0.1, hang_timeout_s=2.0, restart_backoff_s=0.2, stop_timeout_s=2.0,
                       load_timeout_s=120)
    with Bridge(cfg) as bridge:
        bridge.wait_running(120)
        first = _frames(13)
        outputs = bridge.process(first, timeout_s=120)
        bridge.set_params(steps=[700, 500])
        outputs += bridge.process(_frames(8, 13), timeout_s=120)
        assert [int(o[0, 0, 0]) for o in outputs] == list(range(21))
        assert not np.array_equal(outputs[0][:, 8:40], first[0][:, 8:40])  # restyled, not passed through
        assert _wait(lambda: bridge.stats()["engine"].get("session", {}).get("steps") == [700, 500], 20)
        session = bridge.stats()["engine"]["session"]
        assert session["gpus"] == 2 and sum(session["split"]) == 4

        engine_pid = bridge.stats()["engine_pid"]
        ranks = _rank_pids(engine_pid)
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        saw_fallback = False
        i = 100

        def recovered() -> bool:
            nonlocal i, saw_fallback
            frame = _frames(1, i % 200)[0]
            i += 1
            bridge.submit(frame)
            _, status = bridge.latest()
            saw_fallback |= status.fallback
            return status.restarts == 1 and status.state == "running" and bridge.stats()["engine_pid"] != engine_pid

        assert _wait(recovered, 120), bridge.stats()
        assert saw_fallback
        assert "rank 1" in str(bridge.stats()["last_error"]), bridge.stats()["last_error"]
        assert _wait(lambda: not Path(f"/proc/{engine_pid}").exists(), 10)
        assert [int(o[0, 0, 0]) for o in bridge.process(_frames(9, 50), timeout_s=120)] == list(range(50, 59))
