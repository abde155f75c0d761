"""tools/device_ab.sh on a CPU: `prepare` takes files as at a commit, `run` benches the tree, then those files,
and puts the tree's own back (`loom bench` stood in for by a `python3` that records the file it ran with)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "device_ab.sh"

FAKE_PYTHON = """#!/usr/bin/env bash
{ cat engine/step.py; printf '%s ' "$@"; echo; } >> "$AB_LOG"
echo "FPS                             1.00"
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def test_prepare_then_run_benches_both_sides_and_puts_the_tree_back(tmp_path):
    repo = tmp_path / "repo"
    (repo / "engine").mkdir(parents=True)
    (repo / "engine" / "step.py").write_text("before\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "empty")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "before")
    rev = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "engine" / "step.py").write_text("after\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    log = tmp_path / "ab.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "AB_LOG": str(log)}

    def ab(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *args], cwd=repo, env=env, capture_output=True, text=True)

    assert ab("prepare", rev, "engine/missing.py").returncode == 2
    (repo / ".ab" / "old").mkdir(parents=True)
    (repo / ".ab" / "old" / "stale.py").write_text("an earlier A/B's file\n")
    prepared = ab("prepare", rev, "engine/step.py")
    assert prepared.returncode == 0, prepared.stderr
    assert (repo / ".ab" / "engine" / "step.py").read_text() == "before\n"
    assert not (repo / ".ab" / "old").exists()  # only the files named this time are swapped in
    run = ab("run", "vae", "60", "--", "-c", "tiny-random", "--frames", "20")
    assert run.returncode == 0, run.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "after" and calls[2] == "before"  # the tree, then the file as at the commit
    assert "--json" in calls[1] and calls[1].rstrip().endswith("-c tiny-random --frames 20")
    assert "== vae_new" in run.stdout and "== vae_old" in run.stdout and run.stdout.count("FPS") == 2
    assert (repo / "engine" / "step.py").read_text() == "after\n"  # the tree's own file back
    results = {p.name for p in (tmp_path / "out" / "ab").iterdir()}
    assert results == {"vae_new.txt", "vae_old.txt"}  # the runs' outputs alone, no copy of the tree
    assert ab("run", "vae", "60", "-c", "tiny-random").returncode == 2  # no `--`: the usage
