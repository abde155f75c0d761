"""Where a frame's handoff spends its time: opt-in timestamps at each step, in both processes.

A bridge handoff crosses two processes (host, engine) and a dozen CUDA calls; a total alone does
not say which step costs what. With `LOOM_HANDOFF_MARKS=<dir>` in the environment (a launched
engine inherits it), each process stamps named points of every frame's path (`mark(seq, point)`,
`time.perf_counter_ns`, which is CLOCK_MONOTONIC on Linux: one clock for both processes, so the
gaps across processes are real), and times every CUDA runtime call of the device rings under the
step it falls in (`TimedCalls`). An engine writes what it stamped to `<dir>` when it exits; the
benchmark merges both sides per frame (`step_table`). Unset (the default), `mark` returns at once
and no CUDA call is wrapped.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

ENV = "LOOM_HANDOFF_MARKS"
KEEP_FRAMES = 8192  # frames whose marks are kept (the oldest go): bounded memory in a long run
KEEP_CALLS = 65536  # samples kept per CUDA call label

# The points a frame passes, in order, on the way that a host waits for (each stamp names the step that
# starts there); and steps beside that way (`ASIDE`: the host's return from submit, the engine's release
# of the input slot), which overlap it.
HANDOFF_PATH = ("host.submit", "host.stage", "host.slot_copy", "host.notice", "engine.notice", "engine.copy",
                "engine.publish", "host.output_notice", "host.output_release", "host.notify", "host.latest",
                "host.done")
ASIDE = (("host.notice", "host.wait"), ("engine.release", "engine.done"))


class HandoffMarks:
    """One process's stamps; `enabled` false: every call returns at once."""

    def __init__(self, enabled: bool = False, role: str = "host") -> None:
        self.enabled = enabled
        self.role = role
        self.frames: dict[int, dict[str, int]] = {}
        self.calls: dict[str, deque[tuple[int, int]]] = {}  # label -> (seq, ns) per call
        self.step, self.seq = "-", -1  # where the process is: the last point it marked, and its frame

    def mark(self, seq: int, point: str, t_ns: int | None = None) -> None:
        """Stamp `point` of frame `seq` now (or at `t_ns`); the steps that follow are named after it."""
        if not self.enabled:
            return
        stamps = self.frames.get(seq)
        if stamps is None:
            if len(self.frames) >= KEEP_FRAMES:
                del self.frames[next(iter(self.frames))]
            stamps = self.frames[seq] = {}
        stamps[point] = time.perf_counter_ns() if t_ns is None else t_ns
        self.step, self.seq = point, seq

    def call(self, name: str, ns: int) -> None:
        """One CUDA call of `ns` nanoseconds, counted under the current step and frame."""
        label = f"{self.step} {name}"
        samples = self.calls.get(label)
        if samples is None:
            samples = self.calls[label] = deque(maxlen=KEEP_CALLS)
        samples.append((self.seq, ns))

    def reset(self) -> None:
        self.frames.clear()
        self.calls.clear()
        self.step, self.seq = "-", -1

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "pid": os.getpid(), "frames": {str(k): v for k, v in self.frames.items()},
                "calls": {k: list(v) for k, v in self.calls.items()}}

    def dump(self, directory: str | Path) -> Path:
        """Write the stamps to `<directory>/handoff-<role>-<pid>.json`; returns the path."""
        path = Path(directory) / f"handoff-{self.role}-{os.getpid()}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict()))
        return path


def load_dumps(directory: str | Path, role: str) -> list[dict[str, Any]]:
    """Every dump of `role` in the directory (an engine restarted mid-run leaves two)."""
    return [json.loads(p.read_text()) for p in sorted(Path(directory).glob(f"handoff-{role}-*.json"))]


class TimedCalls:
    """Stands in for a CUDA runtime module: its functions are timed into `marks` under their name;
    everything else (types, enums, constants) is the module's own, so `isinstance` checks still hold."""

    def __init__(self, module: Any, marks: HandoffMarks) -> None:
        self._module = module
        self._marks = marks
        self._wrapped: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        wrapped = self._wrapped.get(name)
        if wrapped is not None:
            return wrapped
        attr = getattr(self._module, name)
        if not callable(attr) or isinstance(attr, type):
            return attr
        marks = self._marks

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return attr(*args, **kwargs)
            finally:
                marks.call(name, time.perf_counter_ns() - t0)

        self._wrapped[name] = timed
        return timed


def _stats_us(values: list[int] | np.ndarray) -> dict[str, float]:
    us = np.asarray(values, np.float64) / 1000.0
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()), "min_us": float(us.min()), "n": int(len(us))}


def step_table(frames: list[dict[str, int]], path: list[str]) -> list[dict[str, Any]]:
    """Per step of `path` (points in the order a frame passes them), the time to the next point, over the
    frames that have both: one row per step with its median, p99, mean (microseconds) and count. A
    negative gap across the two processes would mean their clocks differ: it is kept, not hidden."""
    rows = []
    for here, there in zip(path, path[1:]):
        gaps = [f[there] - f[here] for f in frames if here in f and there in f]
        if gaps:
            rows.append({"step": f"{here} -> {there}", **_stats_us(gaps)})
    return rows


def call_table(calls: dict[str, list[tuple[int, int]]], seqs: range) -> list[dict[str, Any]]:
    """One row per timed CUDA call label ("<step> <call>") over the calls made for frames in `seqs`,
    slowest median first."""
    rows = []
    for label, samples in calls.items():
        ns = [n for seq, n in samples if seq in seqs]
        if ns:
            rows.append({"call": label, **_stats_us(ns)})
    return sorted(rows, key=lambda r: -r["p50_us"])


def merge_frames(*sides: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Each frame's stamps from every side (keys: the frame's seq as text)."""
    merged: dict[str, dict[str, int]] = {}
    for side in sides:
        for seq, stamps in side.items():
            merged.setdefault(seq, {}).update(stamps)
    return merged


MARKS = HandoffMarks(enabled=bool(os.environ.get(ENV)))  # this process's stamps


def enable(directory: str | Path) -> None:
    """Stamp in this process, and in every engine it launches from now on (they inherit the variable);
    an engine writes its stamps to `directory` when it exits."""
    os.environ[ENV] = str(directory)
    MARKS.enabled = True
