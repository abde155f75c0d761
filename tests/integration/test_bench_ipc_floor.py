"""`bench_ipc_floor.py` on a CUDA machine: every form hands the caller's frame back unchanged through a second
process, and the table names each form and wait (`pytest -m gpu tests/integration/test_bench_ipc_floor.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_every_form_round_trips_the_frame(tmp_path):
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ipc_floor.py"), "--size", "64x48",
                           "--frames", "20", "--paced-frames", "5", "--fps", "200", "--warmup", "2", "--warm-gpu",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    forms = json.loads(out.read_text())["forms"]
    splits = ("host-copies", "host-copies-early", "engine-copies", "host-copies-cpu", "engine-copies-cpu")
    gpu_ordered = ["host-copies-gpu/gpu", "engine-copies-gpu/gpu"]
    assert sorted(forms) == sorted([f"{f}/{w}" for f in splits for w in ("spin", "pipe")]
                                   + [f"{f}/spin+warm" for f in splits] + gpu_ordered)
    for key, r in forms.items():
        assert r["b2b"]["done"]["n"] == 20 and r["paced"]["done"]["n"] == 5, key
        assert r["b2b"]["notice"]["p50_ms"] <= r["b2b"]["done"]["p50_ms"], key
        assert key in proc.stdout
    assert "one process, pre-queued" in proc.stdout


def test_a_bad_size_or_a_machine_without_a_gpu_is_said_plainly(tmp_path):
    bench = [sys.executable, str(ROOT / "benchmarks" / "bench_ipc_floor.py")]
    bad = subprocess.run([*bench, "--size", "1080p"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--size '1080p': expected WIDTHxHEIGHT" in bad.stderr
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the run itself is the GPU test above")
    out = tmp_path / "floor.json"
    proc = subprocess.run([*bench, "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr and not out.exists()
