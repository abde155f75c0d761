"""The examples run as a user would run them, and do what their docstrings say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from loom_live.plugin.media.generated_clip import generate_clip
from loom_live.plugin.media.sinks import open_sink
from loom_live.plugin.media.sources import open_source

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_in_process_example_restyles_every_frame_of_a_file(tmp_path):
    src, out = tmp_path / "in.mp4", tmp_path / "out.mp4"
    sink = open_sink(src, 24, (96, 64))
    for frame in generate_clip(n_frames=23, size=(96, 64)):  # 5 + 4 * 4 + a tail of 2
        sink.write(frame)
    sink.close()
    # the model at the clip's size with one step (the example's --set, as its usage shows): less work, same path
    printed = _run("restyle_in_process.py", str(src), str(out), "--set", "resolution.width=96", "--set",
                   "resolution.height=64", "--set", "stream.steps=[700]")
    assert printed.startswith("23 frames to") and " by StreamSession " in printed
    with open_source(out) as restyled:
        frames = list(restyled)
    with open_source(src) as original:
        first = original.read()
    assert len(frames) == 23 and frames[0].shape == (64, 96, 3)
    assert abs(frames[0].astype(int) - first.astype(int)).mean() > 1  # restyled, not copied


def test_in_process_example_runs_the_model_family_its_config_names(tmp_path):
    """An edit preset ran the Wan defaults' StreamSession (random tiny weights), silently not the edit model."""
    src, out = tmp_path / "in.mp4", tmp_path / "out.mp4"
    sink = open_sink(src, 24, (64, 64))
    for frame in generate_clip(n_frames=9, size=(64, 64)):
        sink.write(frame)
    sink.close()
    printed = _run("restyle_in_process.py", str(src), str(out), "--config", "edit-tiny")
    assert printed.startswith("9 frames to") and " by EditSession " in printed, printed


def test_host_frame_loop_example_streams_through_a_launched_engine(tmp_path):
    # the embedded default at 64x64 with one step, so a loaded CPU still restyles within the run
    settings = yaml.safe_load((ROOT / "engine" / "presets" / "default.yaml").read_text())
    settings["resolution"] = {"width": 64, "height": 64}
    settings["stream"]["steps"] = [700]
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump(settings))
    printed = _run("host_frame_loop.py", "--seconds", "6", "--fps", "20", "--config", str(config))
    m = re.search(r"(\d+) frames submitted, (\d+) restyled frames shown, \d+ fallbacks; .* restarts (\d+)", printed)
    assert m, printed
    submitted, shown, restarts = map(int, m.groups())
    assert submitted >= 40 and shown > 0 and restarts == 0


def test_host_frame_loop_example_changes_a_parameter_the_edit_family_takes():
    """With an edit preset it set noise_scale, a Wan parameter the edit engine refuses (said only in the status)."""
    printed = _run("host_frame_loop.py", "--seconds", "3", "--fps", "10", "--config", "edit-tiny")
    m = re.search(r"(\d+) frames submitted, .* restarts (\d+), errors (\d+)", printed)
    assert m, printed
    submitted, restarts, errors = map(int, m.groups())
    assert submitted >= 20 and restarts == 0 and errors == 0, printed
