"""The benchmark scripts are run by hand on the GPU machine, not by the suite: what they import from Loom
must still exist, or a device session's call is spent on an ImportError (bench_pipeline.py imported a
function that had moved to the `loom bench` command)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# each script loaded as a module, in one fresh interpreter (their sys.path changes stay there)
IMPORT_ALL = """
import importlib.util, pathlib, sys
failed = []
for path in sorted(pathlib.Path("benchmarks").glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        failed.append(f"{path.name}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
"""


def test_every_benchmark_script_imports():
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
    assert "bench_pipeline.py" in scripts
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", f"benchmark scripts that do not import:\n{done.stdout}"
