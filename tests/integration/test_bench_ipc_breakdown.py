"""`bench_ipc.py --breakdown` over shm with a real pass-through engine process: both processes stamp every
measured frame, on one clock (no step, across the processes included, runs backwards)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loom_live.host_bridge.wire.handoff_marks import ASIDE, HANDOFF_PATH

ROOT = Path(__file__).resolve().parents[2]
FRAMES = 8


def test_breakdown_covers_every_step_of_every_frame(tmp_path):
    out = tmp_path / "ipc.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ipc.py"), "--smoke", "--size", "64x48",
                           "--frames", str(FRAMES), "--warmup", "3", "--breakdown", "--json", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = json.loads(out.read_text())["breakdown"]
    assert parts["engine_stamps"] is True
    tables = parts["64x48 handoff"]
    steps = {row["step"]: row for row in tables["steps"]}
    assert list(steps) == [f"{a} -> {b}" for a, b in zip(HANDOFF_PATH, HANDOFF_PATH[1:])]
    assert all(row["n"] == FRAMES and row["min_us"] >= 0 for row in steps.values())
    assert [row["step"] for row in tables["aside"]] == [f"{a} -> {b}" for a, b in ASIDE]
    assert "where the handoff goes, 64x48 handoff" in proc.stdout
