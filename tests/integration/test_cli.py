"""The `loom` command's entry point and `loom info`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from loom_live.host_bridge.wire.cpu_awake import CpuAwake
from loom_live.plugin.cli.main import main


def test_info_json_reports_the_machine(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("python", "torch", "cuda_available", "gpus", "cuda_ipc", "compiled_steps_kept", "pyzmq", "av",
                "opencv"):
        assert key in info
    assert "default" in info["presets"]
    with CpuAwake() as here:  # the row says what a bridge's hold_cpu_awake would get on this machine
        assert info["hold_cpu_awake"].startswith("can be held" if here.held else f"cannot be held: {here.why}")


def test_info_reports_a_torch_that_does_not_load_instead_of_a_traceback(monkeypatch, capsys):
    """`loom info` is what a user runs when torch is broken (a CUDA library missing): it must still answer."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises, as a broken install does
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"].startswith("not importable") and not info["cuda_available"] and info["gpus"] == []


def test_a_command_whose_library_does_not_load_costs_that_command_only(monkeypatch, capsys):
    """An OpenCV without libGL (a server image) broke every command at start: `loom info`, the command run to
    see what is wrong, must answer, and the command that needs it says why in one line."""
    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` raises, as a missing libGL does
    for name in [m for m in sys.modules if m.startswith("loom_live.plugin.cli.eval")]:
        monkeypatch.delitem(sys.modules, name)
    assert main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loom"]
    assert main(["eval", "--clip", "x.mp4"]) == 2
    assert "loom eval: error: this command cannot run here: a library it needs does not load (" \
        in capsys.readouterr().err


def test_info_table_in_a_real_process():
    out = subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "info"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "cuda_ipc" in out.stdout and "presets" in out.stdout


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    ci = (root / ".ci" / "run").read_text()
    line = next(x for x in ci.splitlines() if x.startswith("TEST_CMD="))
    command = line.split("=", 1)[1].strip("'")
    assert command in (root / "README.md").read_text()


def test_the_one_gpu_session_refuses_several_gpus_clearly():
    from loom_live.engine.config import load_config
    from loom_live.engine.stream.session import StreamSession

    with pytest.raises(ValueError, match="parallel.gpus"):
        StreamSession.from_config(load_config("tiny-random", ["parallel.gpus=2"]), warmup=False)


def test_prepare_on_a_cpu_says_there_is_nothing_to_prepare_and_a_bad_config_fails_at_once(capsys):
    assert main(["prepare", "--set", "model.device=cpu"]) == 0
    assert "nothing to prepare on cpu" in capsys.readouterr().err
    assert main(["prepare", "-c", "no-such-preset"]) == 2
    assert "no-such-preset" in capsys.readouterr().err
    assert main(["bench", "--set", "vae.saved_steps=off"]) == 2  # a text key takes 'off' as typed, not as false
    assert "vae.saved_steps: 'off' is not allowed; expected one of 'load', 'build', 'none'" in capsys.readouterr().err


def test_prepare_on_a_cpu_still_refuses_a_config_whose_weights_are_missing(tmp_path, monkeypatch, capsys):
    """"nothing to prepare" (exit 0) was said of a Wan preset with no weights, whose show start then failed."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # an empty Hugging Face cache: nothing pulled
    assert main(["prepare", "-c", "wan2.1-1.3b", "--set", "model.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "needs weights that are not here" in err and "loom pull wan2.1-1.3b" in err and "nothing to" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="an engine compiles ahead only on CUDA")
def test_prepare_keeps_a_configs_steps_and_the_next_start_loads_every_one(tmp_path):
    env = {**os.environ, "LOOM_CACHE_DIR": str(tmp_path / "cache")}
    counts = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "prepare", "-c", "tiny-random"],
                             capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        found = re.search(r"(\d+) built and kept, (\d+) already kept", out.stderr)
        assert found, out.stderr[-3000:]
        assert "loom prepare: compiling and warming up: stream 1 (" in out.stderr  # its minutes, phase by phase
        counts.append((int(found[1]), int(found[2])))
    assert counts[0][0] > 0 and counts == [(counts[0][0], 0), (0, counts[0][0])]
    info = subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "info", "--json"], capture_output=True,
                          text=True, timeout=120, env=env, check=True)
    assert json.loads(info.stdout)["compiled_steps_kept"].startswith(f"{counts[0][0]} in ")
