"""The recovery bench's reading of an engine's log: its start-up line, not the compile-phase line the
engine writes after it."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.bench_recovery import startup_line


def _bridge(lines: list[str]) -> SimpleNamespace:
    return SimpleNamespace(status=lambda: SimpleNamespace(log_tail=lines))


def test_the_start_up_line_is_found_behind_the_compile_line_and_its_log_prefix():
    line = "start-up 22.3 s (the process ran 7.4 s before): load 5.8 s; warmup 11.0 s (compile 6.1 s)"
    log = ["INFO loom: loading", f"INFO loom_live.engine.stream.session: {line}",
           "INFO loom_live.engine.stream.session: compile phases so far, nested: _compile.compile_inner 6.1 s (24)"]
    assert startup_line(_bridge(log)) == line
    assert startup_line(_bridge(log[:1])) is None


def test_the_reads_summary_counts_the_slow_reads_and_says_none_for_no_reads():
    from benchmarks.bench_recovery import read_summary

    summary = read_summary([0.001] * 95 + [0.0052] * 5, fresh=90)
    assert summary["reads"] == 100 and summary["slow"] == 5 and summary["fresh"] == 90
    assert summary["p50_ms"] == 1.0 and 5.0 < summary["p99_ms"] <= 5.2
    assert read_summary([]) == {"reads": 0, "p50_ms": None, "p99_ms": None, "slow": 0, "fresh": 0}
