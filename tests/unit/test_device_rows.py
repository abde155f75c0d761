"""tools/device_rows.sh on a CPU: every command its groups would run on a lent GPU machine parses, names
files that exist and loads its config, so a scarce device call is not lost to an option or a config key
renamed since (each group runs here with `python3` and `timeout` stood in for, recording what they got, and
NVIDIA's MPS control program doing nothing)."""

from __future__ import annotations

import argparse
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "device_rows.sh"
ONE_CALL_S = 600  # a device call's longest run (the device README)

FAKE_PYTHON = """#!/usr/bin/env bash
{ printf '%s\\x1f' "$@"; printf '\\x1e'; } >> "$ROWS_LOG"
[ "$1" = "-" ] && exit 1  # a reader of a step's results: none here, so the script's fallback is taken
exit 0
"""
FAKE_TIMEOUT = """#!/usr/bin/env bash
echo "$1" >> "$LIMITS_LOG"
shift
exec "$@"
"""
FAKE_MPS_CONTROL = """#!/usr/bin/env bash
[ "$1" = "-d" ] || cat > /dev/null  # the daemon started, or a command (quit) read from stdin
exit 0
"""


def _groups() -> list[str]:
    return re.search(r'^groups="([^"]+)"', SCRIPT.read_text(), re.M)[1].split()


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, tuple[list[list[str]], list[int]]]:
    """Each group's python3 command lines and its steps' limits, as the script would run them."""
    tmp = tmp_path_factory.mktemp("device_rows")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, text in (("python3", FAKE_PYTHON), ("timeout", FAKE_TIMEOUT),
                       ("nvidia-cuda-mps-control", FAKE_MPS_CONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    found = {}
    for group in _groups():
        log, limits = tmp / f"{group}.log", tmp / f"{group}.limits"
        log.touch()
        limits.touch()
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(tmp / group),
               "ROWS_LOG": str(log), "LIMITS_LOG": str(limits)}
        done = subprocess.run(["bash", str(SCRIPT), group], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        commands = [c.split("\x1f")[:-1] for c in log.read_text().split("\x1e")[:-1]]
        found[group] = ([c for c in commands if c[:2] != ["-m", "pip"]],
                        [int(v) for v in limits.read_text().split()])
    return found


class _Started(Exception):
    """Where the engine would start: everything before it (options, config, refusals) has passed."""


def _stop(*args, **kwargs):
    raise _Started


def _loom(argv: list[str], monkeypatch) -> None:
    """`loom ARGV` as on a GPU machine, up to the engine's start."""
    from loom_live.engine import session_api
    from loom_live.engine.models import loading
    from loom_live.engine.tools import bench, bench_edit
    from loom_live.plugin.cli import bench as bench_cli
    from loom_live.plugin.cli.main import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(loading, "resolve_device", lambda spec: torch.device("cuda"))
    for module, name in ((bench, "run_loom"), (bench_edit, "run_edit"), (session_api, "open_session")):
        monkeypatch.setattr(module, name, _stop)
    monkeypatch.setattr(bench_cli, "clip_frames", lambda cfg, source, count: np.zeros((count, 8, 8, 3), np.uint8))
    args = build_parser().parse_args(argv)
    with pytest.raises(_Started):
        args.func(args)


def _script(argv: list[str], monkeypatch) -> None:
    """A benchmark script's own argument parsing on these arguments (it stops right after)."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Started

    with monkeypatch.context() as patch, pytest.raises(_Started):
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        patch.setattr(sys, "argv", argv)
        patch.setattr(sys, "path", list(sys.path))
        runpy.run_path(str(ROOT / argv[0]), run_name="__main__")


@pytest.mark.parametrize("group", _groups())
def test_every_command_of_a_group_parses_names_files_that_exist_and_loads_its_config(group, rows, monkeypatch):
    commands, limits = rows[group]
    assert commands and len(limits) >= 1
    for command in commands:
        if command[0] == "-":  # an inline reader of a step's results
            continue
        if command[:2] == ["-m", "loom_live.plugin.cli"]:
            assert command[2] in ("bench", "prepare"), command
            _loom(command[2:], monkeypatch)
        elif command[:2] == ["-m", "pytest"]:
            files = [a for a in command if a.endswith(".py") or "::" in a]
            assert files and "gpu" in command, command
            for name in files:
                path = ROOT / name.split("::")[0]
                assert path.is_file(), name
                assert "mark.gpu" in path.read_text() or "pytestmark" in path.read_text(), name
        else:
            assert command[0].startswith("benchmarks/") and (ROOT / command[0]).is_file(), command
            _script(command, monkeypatch)


def test_the_14b_fp8_pair_the_preset_is_decided_on_fits_one_device_call(rows):
    """The autotuned row and the heuristic one, both in one call: with the compiled quantisation's row
    between them the group's rows were about 14 minutes, and the heuristic one, last, would have been cut."""
    commands, limits = rows["fp8-14b"]
    assert sum(limits) <= ONE_CALL_S - 30  # device_env.sh and the steps' own start-up
    sets = [" ".join(c) for c in commands]
    assert any("model.autotune_kernels=false" in s for s in sets)
    assert not any("model.autotune_kernels=false" in s or "fp8_quantize" in s for s in sets[:1])
