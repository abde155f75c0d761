"""`loom serve` as a user meets it: clear errors, clean exits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from loom_live.plugin.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom_live.engine", "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_bad_config_fails_before_serving_with_the_key(capsys):
    code = main(["serve", "--connect", "ipc:///nonexistent/x", "--set", "stream.stepz=[700]"])
    assert code == 2
    assert "stream.stepz: unknown key" in capsys.readouterr().err


def test_an_engine_nobody_talks_to_gives_up(tmp_path):
    t0 = time.monotonic()
    out = _serve("--connect", f"ipc://{tmp_path}/nobody", "--passthrough", "--handshake-timeout", "1")
    assert out.returncode == 4 and "no hello from the host" in out.stderr
    assert time.monotonic() - t0 < 30


def test_curve_flags_go_together():
    out = _serve("--bind", "tcp://127.0.0.1:5598", "--curve-secret-file", "x.key_secret")
    assert out.returncode == 2 and "go together" in out.stderr
