"""A Python snippet run under triton in a child process of its own, for the tests of Loom's Triton kernels.

Why a child: Triton reads TRITON_INTERPRET when a kernel is defined, so the interpreter (the kernels'
numbers on a CPU) and the compiler (their build for a GPU) cannot share the test process, nor disturb it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_triton(code: str, *, interpret: bool, timeout: float = 600, cache_dir: Path | None = None) -> list[str]:
    """Run `code` from the repository root with triton (the test skips without it): in Triton's interpreter
    when `interpret`, else compiling for real (into `cache_dir` if given). Its stdout's lines; the test fails
    with the tail of its stderr if it exits non-zero."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if cache_dir is not None:
        env["TRITON_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()
