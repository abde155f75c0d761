"""`loom bench` end to end on the embedded default: the table and JSON a user reads."""

from __future__ import annotations

import json

from engine.cli import main


def test_bench_reports_pipeline_bridge_and_baseline(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--config", "tiny-random", "--frames", "24", "--warmup", "9", "--bridge", "shm",
               "--bridge-frames", "30", "--baseline-chunks", "2", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    for row in ("FPS", "time to first frame", "latency p95/p99/max", "chunk period", "stage dit", "stage bridge",
                "Loom / baseline"):
        assert row in table
    result = json.loads(out.read_text())
    loom = result["loom"]
    # outputs counted in the timed window: the 24 pushed frames, shifted by the chunks in flight
    in_flight = 4 * len(result["steps"])
    assert abs(loom["measured_frames"] - 24) <= in_flight and loom["fps"] > 0 and loom["dropped"] == 0
    assert loom["latency_ms"]["p99"] >= loom["latency_ms"]["p50"] > 0
    assert {"encode", "dit", "decode"} <= set(loom["stages_ms"])
    assert result["bridge"]["transport"] == "shm" and result["bridge"]["n"] == 30
    assert result["bridge"]["width"] == result["config"]["resolution"]["width"]
    assert result["baseline"]["fps"] > 0


def test_bench_refuses_a_bad_override(capsys):
    assert main(["bench", "--config", "tiny-random", "--set", "stream.steps=[100,500]", "--bridge", "none"]) == 2
    assert "steps" in capsys.readouterr().err
