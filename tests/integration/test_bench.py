"""`loom bench` end to end on the embedded default: the table and JSON a user reads."""

from __future__ import annotations

import json

import pytest

from host_bridge.wire.errors import UserError
from plugin.cli.main import main


def test_bench_reports_pipeline_and_bridge(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--frames", "24", "--warmup", "9", "--bridge", "shm", "--bridge-frames", "30",
               "--json", str(out)])
    assert rc == 0
    captured = capsys.readouterr()
    table = captured.out
    for row in ("FPS", "time to first frame", "latency p95/p99/max", "chunk period", "stage dit", "stage bridge"):
        assert row in table
    assert "baseline" not in table, "the embedded model has no diffusers counterpart to compare with"
    assert "24/24" in captured.err, "progress ends at N/N"
    result = json.loads(out.read_text())
    loom = result["loom"]
    # outputs counted in the timed window: the 24 pushed frames, shifted by the chunks in flight
    in_flight = 4 * len(result["steps"])
    assert abs(loom["measured_frames"] - 24) <= in_flight and loom["fps"] > 0 and loom["dropped"] == 0
    assert loom["latency_ms"]["p99"] >= loom["latency_ms"]["p50"] > 0
    assert {"encode", "dit", "decode"} <= set(loom["stages_ms"])
    assert result["bridge"]["transport"] == "shm" and result["bridge"]["n"] == 30
    assert result["bridge"]["width"] == result["config"]["resolution"]["width"]
    assert result["preset"] == "tiny", "bench defaults to the same preset as every other command"


def test_bench_says_why_it_will_not_run_what_cannot_finish_or_compare(capsys):
    assert main(["bench", "--baseline", "--bridge", "none"]) == 2
    assert "no such counterpart" in capsys.readouterr().err
    from engine.config import load_config
    from plugin.cli.bench import CPU_FRAMES, plan

    assert plan(load_config("default"), None, None, cuda=False) == (CPU_FRAMES, False)
    assert plan(load_config("wan2.1-1.3b", ["model.random_weights=true"]), None, None, cuda=True) == (3000, True)
    with pytest.raises(UserError, match="on a CPU"):
        plan(load_config("wan2.1-1.3b", ["model.random_weights=true"]), None, None, cuda=False)


def test_bench_refuses_a_bad_override(capsys):
    assert main(["bench", "--config", "default", "--set", "stream.steps=[100,500]", "--bridge", "none"]) == 2
    assert "steps" in capsys.readouterr().err
