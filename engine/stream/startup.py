"""Where an engine's start-up goes: model build and weights, compilation, graph capture, warm-up.

Why: a restarted engine keeps a show in fallback until its first restyled frame, and the time
is spent in several places that need different remedies (weights built on the device, compiled
artefacts loaded from the persistent cache, fewer captured shapes). The session records each
phase here, logs one line when it is ready and reports the same figures in its stats.
Compilation and capture happen inside the warm-up (on first use), so they are read from their
own process-wide counters (`CAPTURES`, torch's compile metrics) and reported beside it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from loom_live.engine.graphs.capture_clock import CAPTURES
from loom_live.engine.graphs.saved_compiles import SAVED
from loom_live.engine.startup_progress import STARTUP_PROGRESS

# What a host waiting on the start is told at each phase (a phase's parts follow its words)
PHASE_WORDS = {"load": "loading the model", "session": "setting up the stream", "warmup": "compiling and warming up",
               "warmup_plans": "warming up the other chunk sizes the scheduler may pick"}

# Triton's timing of a fresh kernel's candidate block sizes, at its first launch: after its compile, so outside
# `compile_s`, and skipped once the compile cache holds the choice (a cold start pays it, a warm one not)
AUTOTUNE_PHASES = ("CachingAutotuner.benchmark_all_configs", "CachingAutotuner.coordinate_descent_tuning")


def compile_totals() -> dict[str, float]:
    """Seconds torch.compile spent so far in this process (tracing, Inductor, cache loads included),
    frames compiled, and the Inductor FX graph cache's hits and misses (0 where torch has no such counter).

    Reads the counters without importing torch's compiler (seconds of imports): a process that has
    not loaded it has compiled nothing, and the phase that first needs it is charged for its import."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {"compile_s": 0.0, "compiled_frames": 0.0, "fx_cache_hits": 0.0, "fx_cache_misses": 0.0,
                "autotune_s": 0.0, "kernel_wait_s": 0.0}
    metrics = getattr(utils, "compilation_time_metrics", {})
    counters = getattr(utils, "counters", {})
    inductor = counters.get("inductor", {})
    return {"compile_s": float(sum(metrics.get("_compile.compile_inner", ()))),
            "compiled_frames": float(counters.get("frames", {}).get("ok", 0)),
            "fx_cache_hits": float(inductor.get("fxgraph_cache_hit", 0)),
            "fx_cache_misses": float(inductor.get("fxgraph_cache_miss", 0)),
            "autotune_s": float(sum(sum(metrics.get(name, ())) for name in AUTOTUNE_PHASES)),
            "kernel_wait_s": float(sum(metrics.get("async_compile.wait", ())))}


def compile_phases(top: int = 8) -> list[tuple[str, float, int]]:
    """torch.compile's own timed phases so far in this process, longest first: (name, seconds, calls).
    Nested (the outermost holds the rest), so they say where compile time went: tracing, the caches'
    lookups and loads, code generation. Empty where torch's compiler was never imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    metrics = getattr(utils, "compilation_time_metrics", {}) if utils is not None else {}
    rows = [(name, float(sum(times)), len(times)) for name, times in metrics.items() if len(times)]
    return sorted(rows, key=lambda row: -row[1])[:top]


def first_calls() -> list[tuple[str, float, int]]:
    """Each saved-compile step's first calls so far in this process, longest first: (name, seconds, signatures)."""
    rows = [(name, sum(times), len(times)) for name, times in SAVED.first_calls.items()]
    return sorted(rows, key=lambda row: -row[1])


def process_age_s() -> float | None:
    """Seconds since this process started, as the OS counts them (Linux's /proc), or None where it cannot
    say. Before an engine loads anything it has started an interpreter, imported torch, initialised CUDA
    and answered the bridge: time a restart pays that the phases below do not show."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rpartition(")")[2].split()  # the name may hold spaces; fields from the 3rd
        started = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time after boot, in ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return age if 0.0 <= age < 1e6 else None


def _work() -> dict[str, float]:
    return {**compile_totals(), "capture_s": CAPTURES.seconds, "captures": float(CAPTURES.count),
            "saved_loaded": float(SAVED.loaded), "saved_load_s": SAVED.load_s, "saved_built": float(SAVED.built),
            "saved_unsaved": float(SAVED.unsaved), "saved_fallbacks": float(SAVED.fallbacks)}


class StartupTimes:
    """Phases in the order they ran, each in seconds, with the compile and capture work done inside each."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.inside: dict[str, dict[str, float]] = {}
        self.detail: dict[str, dict[str, float]] = {}  # a phase's own parts (the load's: dit, vae, lora, ...)
        self.before_s: float | None = None  # how long the process had run when the first phase began

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        STARTUP_PROGRESS.say(PHASE_WORDS.get(name, name))
        t0, before = time.perf_counter(), _work()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)
            after = _work()
            done = {k: after[k] - before[k] for k in after if after[k] != before[k]}
            if done:
                self.inside[name] = done

    @contextmanager
    def part(self, phase: str, name: str) -> Iterator[None]:
        """Time one part of `phase` (inside it): the line shows the parts in brackets after the phase, so
        a phase's own work (a warm-up's chunks, cuDNN's autotuning) stands beside its compile time."""
        STARTUP_PROGRESS.say(f"{PHASE_WORDS.get(phase, phase)}: {name}")
        t0 = time.perf_counter()
        try:
            yield
        finally:
            parts = self.detail.setdefault(phase, {})
            parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0

    def note_process_age(self) -> None:
        """Record how long the process has run so far (called as the first phase begins)."""
        self.before_s = process_age_s()

    def as_dict(self) -> dict[str, Any]:
        return {"total_s": round(sum(self.phases.values()), 3),
                "before_s": None if self.before_s is None else round(self.before_s, 3),
                "phases_s": {k: round(v, 3) for k, v in self.phases.items()},
                "inside": {k: {n: round(x, 3) for n, x in v.items()} for k, v in self.inside.items()},
                "detail_s": {k: {n: round(x, 3) for n, x in v.items()} for k, v in self.detail.items()},
                "compile_phases_s": {n: round(s, 3) for n, s, _ in compile_phases()},
                "first_calls_s": {n: round(s, 3) for n, s, _ in first_calls()}}

    def line(self) -> str:
        """One log line: the total, each phase, and the compile and capture time inside the phases."""
        parts = [f"{name} {seconds:.1f} s{_parts(self.detail.get(name, {}))}{_inside(self.inside.get(name, {}))}"
                 for name, seconds in self.phases.items()]
        before = "" if self.before_s is None else f" (the process ran {self.before_s:.1f} s before)"
        return f"start-up {sum(self.phases.values()):.1f} s{before}: " + "; ".join(parts)

    def unsaved_line(self) -> str | None:
        """A hint when the start compiled steps it could have loaded whole (none kept for this config yet)."""
        unsaved = sum(int(work.get("saved_unsaved", 0)) for work in self.inside.values())
        if not unsaved:
            return None
        return (f"{unsaved} compiled steps were traced, not loaded: none kept yet for this config, engine, torch "
                "and GPU; `loom prepare` with this config keeps them, so later starts load them")

    @staticmethod
    def first_calls_line(top: int = 6) -> str | None:
        """One log line: the compiled steps whose first calls took longest (load or compile, autotuning and
        one run, over all their signatures), so a cold start says which step it waited for."""
        slowest = first_calls()[:top]
        if not slowest:
            return None
        return "compiled steps' first calls, longest: " + ", ".join(
            f"{name} {seconds:.1f} s ({calls})" for name, seconds, calls in slowest)

    @staticmethod
    def compile_line() -> str | None:
        """One log line: torch.compile's longest phases in this process, nested (None: nothing compiled)."""
        phases = compile_phases()
        if not phases:
            return None
        return "compile phases so far, nested: " + ", ".join(f"{n} {s:.1f} s ({c})" for n, s, c in phases)


def _parts(detail: dict[str, float]) -> str:
    return f" [{', '.join(f'{k} {v:.1f} s' for k, v in detail.items())}]" if detail else ""


def _inside(work: dict[str, float]) -> str:
    extra = []
    if work.get("compile_s"):
        wait = work.get("kernel_wait_s")
        waited = f", {wait:.1f} s of it awaiting Triton's compiles" if wait else ""
        extra.append(f"compile {work['compile_s']:.1f} s{waited}")
    if work.get("fx_cache_hits") or work.get("fx_cache_misses"):
        extra.append(f"fx cache {int(work.get('fx_cache_hits', 0))} hit / {int(work.get('fx_cache_misses', 0))} miss")
    if work.get("autotune_s"):
        extra.append(f"Triton autotuning {work['autotune_s']:.1f} s")
    counts = [int(work.get(f"saved_{k}", 0)) for k in ("loaded", "built", "unsaved", "fallbacks")]
    if any(counts):
        extra.append(f"saved steps {counts[0]} loaded {work.get('saved_load_s', 0.0):.1f} s / {counts[1]} built / "
                     f"{counts[2]} not saved / {counts[3]} fell back")
    if work.get("captures"):
        extra.append(f"{int(work['captures'])} captures {work['capture_s']:.1f} s")
    return f" ({', '.join(extra)})" if extra else ""
