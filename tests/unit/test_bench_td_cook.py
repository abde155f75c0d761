"""The TouchDesigner cook benchmark's model engine: a config file of a preset on random weights that the
engine loads as `loom bench` would run it, and a refused name said in one line; an engine the operator
cannot start fails the run at once, naming why."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks.bench_td_cook import _costliest_calls, _time_per_frame, model_config, run
from loom_live.engine.config import load_config


def test_a_preset_becomes_a_config_file_on_random_weights(tmp_path):
    cfg = load_config(str(model_config("wan2.1-1.3b", tmp_path)))
    assert cfg.model.preset == "wan2.1-1.3b" and cfg.model.random_weights and cfg.vae.random_weights
    assert cfg.prompt.encoder == "hash"  # no text encoder's weights to read
    assert cfg.resolution == load_config("wan2.1-1.3b").resolution  # the preset otherwise as shipped


def test_an_unknown_preset_is_refused_naming_the_presets(tmp_path):
    with pytest.raises(SystemExit, match=r"--config 'wan9': expected one of .*wan2.1-1.3b"):
        model_config("wan9", tmp_path)


def test_an_engine_the_operator_cannot_start_fails_the_run_at_once_saying_why(monkeypatch):
    """A device call lost minutes to a bench that waited its whole start-up limit on a Python without pyzmq."""
    from loom_live.plugin.touchdesigner import loom_ext

    monkeypatch.setattr(loom_ext, "missing_dependency", lambda: "TouchDesigner's Python lacks 'pyzmq'")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"engine not running: error TouchDesigner's Python lacks 'pyzmq'"):
        run("shm", 64, 64, seconds=1.0, fps=60.0, start_s=250.0)
    assert time.monotonic() - t0 < 120  # not the start-up limit (250 s)


def test_the_engine_worker_s_time_is_given_per_frame_taken_over_the_measured_span():
    before = {"frames_in": 100,
              "time_ms": {"read": 10.0, "session": 500.0, "waiting": 300.0, "emit": 20.0, "write": 8.0}}
    after = {"frames_in": 140,
             "time_ms": {"read": 30.0, "session": 1500.0, "waiting": 700.0, "emit": 60.0, "write": 20.0}}
    assert _time_per_frame(before, after) == {"read": 0.5, "session": 25.0, "waiting": 10.0, "emit": 1.0,
                                              "write": 0.3}
    assert _time_per_frame({"frames_in": 1}, after) is None  # an engine that does not report it


def test_the_engine_s_cuda_calls_are_listed_costliest_in_total_first(tmp_path):
    """Many quick calls can cost more than a few slow ones: the list says where the time went, over every dump
    (an engine restarted mid-run leaves two)."""
    dumps = {"1": {"engine.notice cudaStreamSynchronize": [[1, 900_000], [2, 1_100_000]]},
             "2": {"engine.notice cudaEventRecord": [[i, 20_000] for i in range(200)],
                   "- cudaGetDeviceCount": [[-1, 50_000]]}}
    for pid, calls in dumps.items():
        (tmp_path / f"handoff-engine-{pid}.json").write_text(json.dumps({"role": "engine", "calls": calls}))
    rows = _costliest_calls(tmp_path)
    assert [(r["call"], r["n"], r["total_ms"]) for r in rows] == [
        ("engine.notice cudaEventRecord", 200, 4.0), ("engine.notice cudaStreamSynchronize", 2, 2.0),
        ("- cudaGetDeviceCount", 1, 0.05)]
