"""The warm-up streams every chunk shape the SLO scheduler can pick mid-stream (and only the plans the
config lets it pick), and the session reports where its start-up went."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.graphs.capture_clock import CAPTURES
from loom_live.engine.models.loading import load_models
from loom_live.engine.stream.session import StreamSession
from loom_live.engine.stream.slo_scheduler import Plan
from loom_live.engine.stream.startup import StartupTimes

SMALL = ["resolution.width=32", "resolution.height=32", "stream.rope_refresh_at=8"]


@pytest.fixture(autouse=True)
def one_thread():
    """Two CPU threads contend on a shared box and make these small forwards 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _recording_session(overrides: list[str]) -> tuple[StreamSession, list[tuple]]:
    """A session whose DiT records the shape of every streaming forward (rows, latents, grid)."""
    cfg = load_config("default", [*SMALL, *overrides])
    models = load_models(cfg)
    seen: list[tuple] = []
    forward = models.dit.forward_stream

    def recording(x, t, cache, cross, commit=True, **inputs):
        seen.append(tuple(x.shape))
        return forward(x, t, cache, cross, commit, **inputs)

    models.dit.forward_stream = recording
    return StreamSession(cfg, models), seen


def test_the_warm_up_runs_every_shape_the_scheduler_can_pick_mid_stream():
    session, seen = _recording_session([])
    session.warmup(streams=1)
    assert set(session.warmed_plans) == set(session.slo.candidates)  # stream.mode auto: all of them
    assert len(session.slo.candidates) == 6  # batch and sequential, 1 to 3 latents (a 3-frame ring)
    warmed = set(seen)
    seen.clear()
    # a live stream that the scheduler moves through every plan, in an order the warm-up did not use
    session.slo.decide = lambda: session.slo.plan
    frames = np.random.default_rng(5).integers(0, 256, (5, 32, 32, 3), np.uint8)
    session.push(frames)
    for plan in reversed(session.slo.candidates):
        session.slo.hold(plan)
        for _ in range(3):
            session.push(frames[:4 * plan.chunk_latents])
    session.flush()
    assert seen and set(seen) <= warmed
    assert {s[2] for s in seen} == {1, 2, 3}  # the live stream did use every chunk size


def test_a_pinned_mode_warms_only_the_plan_it_can_use():
    session, seen = _recording_session(["stream.mode=batch"])
    session.warmup(streams=1)
    assert session.warmed_plans == [Plan("batch", 1)]
    auto, auto_seen = _recording_session([])
    auto.warmup(streams=1)
    assert set(seen) < set(auto_seen)


def test_start_up_is_broken_down_in_the_stats_and_the_log(caplog):
    caplog.set_level("INFO", logger="loom_live.engine.stream.session")
    session = StreamSession.from_config(load_config("default", SMALL), warmup=False)
    startup = session.stats()["startup"]
    assert list(startup["phases_s"]) == ["load", "session"]
    assert list(startup["detail_s"]["load"]) == ["setup", "dit", "vae", "lora", "prepare"]
    assert sum(startup["detail_s"]["load"].values()) == pytest.approx(startup["phases_s"]["load"], abs=0.05)
    assert startup["total_s"] == pytest.approx(sum(startup["phases_s"].values()), abs=0.01)
    assert "start-up" in caplog.text and "load" in caplog.text
    if sys.platform == "linux":  # what the process did before the load: the interpreter, imports, a handshake
        assert startup["before_s"] > 0 and "the process ran" in caplog.text
    session.warmup(streams=1, chunks=3)
    startup = session.stats()["startup"]
    assert {"warmup", "warmup_plans"} <= set(startup["phases_s"])
    warm = startup["detail_s"]["warmup"]  # each warm-up stream's own seconds, beside the phase's compile time
    assert list(warm) == ["stream 1 (3 chunks)"]
    assert warm["stream 1 (3 chunks)"] == pytest.approx(startup["phases_s"]["warmup"], abs=0.05)
    plans = [f"{p.mode} x{p.chunk_latents}" for p in session.warmed_plans[1:]]
    assert plans and list(startup["detail_s"]["warmup_plans"]) == plans
    assert "[stream 1 (3 chunks)" in caplog.text


def test_captures_inside_a_phase_are_counted_there():
    times = StartupTimes()
    with times.phase("warmup"):
        with CAPTURES.timed():
            pass
    with times.phase("other"):
        pass
    assert times.inside["warmup"]["captures"] == 1 and "other" not in times.inside
    assert "1 captures" in times.line()


def test_a_phase_names_its_saved_steps_and_a_start_that_kept_none_names_loom_prepare(monkeypatch):
    from loom_live.engine.graphs.saved_compiles import SAVED

    times = StartupTimes()
    with times.phase("warmup"):
        for field, n in (("loaded", 3), ("built", 0), ("unsaved", 18), ("fallbacks", 1)):
            monkeypatch.setattr(SAVED, field, getattr(SAVED, field) + n)
    assert "saved steps 3 loaded 0.0 s / 0 built / 18 not saved / 1 fell back" in times.line()
    hint = times.unsaved_line()
    assert "18 compiled steps were traced, not loaded" in hint and "loom prepare" in hint
    assert StartupTimes().unsaved_line() is None


@pytest.mark.skipif(sys.platform != "linux", reason="the process's start time is read from /proc")
def test_the_process_age_counts_from_the_process_start():
    code = ("import time\n"
            "time.sleep(0.4)\n"
            "from loom_live.engine.stream.startup import process_age_s\n"
            "print(process_age_s())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert 0.4 <= float(out.stdout) < 60


def test_the_compile_line_names_the_longest_phases_first(monkeypatch):
    import types

    from loom_live.engine.stream.startup import compile_phases

    fake = types.SimpleNamespace(compilation_time_metrics={"_compile.compile_inner": [1.0, 2.5],
                                                           "FxGraphCache.load": [0.25], "unused": []})
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", fake)
    assert compile_phases() == [("_compile.compile_inner", 3.5, 2), ("FxGraphCache.load", 0.25, 1)]
    assert StartupTimes.compile_line() == ("compile phases so far, nested: _compile.compile_inner 3.5 s (2), "
                                           "FxGraphCache.load 0.2 s (1)")
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", None)
    assert StartupTimes.compile_line() is None


def test_start_up_phases_do_not_import_the_compiler():
    """Reading the compile counters must not import torch._dynamo (seconds): a CPU engine never needs it,
    and on a GPU the phase that first compiles is the one charged for the import."""
    code = ("import sys\n"
            "from loom_live.engine.stream.startup import StartupTimes, compile_totals\n"
            "times = StartupTimes()\n"
            "with times.phase('load'):\n"
            "    pass\n"
            "assert compile_totals()['compile_s'] == 0.0 and times.compile_line() is None\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_a_phase_names_triton_s_autotuning_and_compile_waits_and_the_slowest_steps(monkeypatch):
    import types

    from loom_live.engine.graphs.saved_compiles import SAVED

    metrics: dict[str, list[float]] = {"_compile.compile_inner": [], "async_compile.wait": [],
                                       "CachingAutotuner.benchmark_all_configs": []}
    monkeypatch.setitem(sys.modules, "torch._dynamo.utils", types.SimpleNamespace(
        compilation_time_metrics=metrics, counters={}))
    monkeypatch.setattr(SAVED, "first_calls", {})
    times = StartupTimes()
    with times.phase("warmup"):
        metrics["_compile.compile_inner"].append(40.0)
        metrics["async_compile.wait"].append(12.5)
        metrics["CachingAutotuner.benchmark_all_configs"] += [3.0, 1.5]
        for name, seconds in (("dit.rotate", 1.0), ("wan_vae.decoder", 20.0), ("dit.rotate", 0.5)):
            SAVED.note_first_call(name, seconds)
    line = times.line()
    assert "compile 40.0 s, 12.5 s of it awaiting Triton's compiles" in line and "Triton autotuning 4.5 s" in line
    assert times.first_calls_line() == ("compiled steps' first calls, longest: "
                                        "wan_vae.decoder 20.0 s (1), dit.rotate 1.5 s (2)")
    assert times.as_dict()["first_calls_s"] == {"wan_vae.decoder": 20.0, "dit.rotate": 1.5}
    monkeypatch.setattr(SAVED, "first_calls", {})
    assert StartupTimes().first_calls_line() is None


def test_a_start_says_each_phase_and_each_warm_up_stream_as_it_begins():
    """What a host waiting on the start is shown (engine/startup_progress.py), in order."""
    from loom_live.engine.startup_progress import STARTUP_PROGRESS

    said: list[str] = []
    with STARTUP_PROGRESS.to(said.append):
        session = StreamSession.from_config(load_config("default", SMALL), warmup=False)
        session.warmup(streams=1)
    assert said[:3] == ["loading the model", "setting up the stream", "compiling and warming up"]
    assert said[3].startswith("compiling and warming up: stream 1 (") and said[3].endswith(" chunks)")
    assert said[4] == "warming up the other chunk sizes the scheduler may pick"
    assert all(s.startswith("warming up the other chunk sizes the scheduler may pick: ") for s in said[5:])
