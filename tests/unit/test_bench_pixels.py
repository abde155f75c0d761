"""`bench_pixels.py`: every host layout timed in both forms (OpenCV, numpy alone), one table and the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_times_every_layout_both_ways_and_writes_its_json(tmp_path):
    out = tmp_path / "pixels.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_pixels.py"), "--size", "64x48",
                           "--repeats", "2", "--json", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 7 and all(set(forms) == {"opencv", "numpy"} for forms in cases.values())
    assert all(forms[f]["n"] == 2 for forms in cases.values() for f in forms)
    assert "frame conversions at 64x48" in proc.stdout and "TouchDesigner RGBA float32" in proc.stdout
