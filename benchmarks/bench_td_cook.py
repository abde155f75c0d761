"""Main-thread time of the Loom TouchDesigner operator's cook at 1920x1080, TouchDesigner left out.

What TouchDesigner's main thread spends in Loom's own code each frame: `LoomExt.Cook` with a real
`Bridge` and a real pass-through engine process (`loom serve --passthrough`), on stand-in TD objects
(tests/fakes/touchdesigner.py) that hand out realistic arrays at no cost of their own. TD's own work
is not counted: the GPU download behind `numpyArray(delayed=True)`, the copy behind `cudaMemory()`,
and the upload behind `copyNumpyArray` / `copyCUDAMemory`. Cooks are paced at `--fps` as TD's frame
loop would call them; the first second after the engine runs is warm-up and not counted.

shm (any machine; the input TOP's numpyArray() is float32 RGBA, as TouchDesigner hands it out):
    python benchmarks/bench_td_cook.py --transport shm --json out/bench_td_cook_shm.json
cuda-ipc (GPU machine with cuda-python; the texture is uint8 BGRA in device memory):
    python benchmarks/bench_td_cook.py --transport cuda-ipc --json out/bench_td_cook_cuda.json
With a model engine instead (`--config PRESET`, on random weights): the cook's copies then share the GPU with
the model's work, as they do on stage (on one GPU the processes' contexts take turns):
    python benchmarks/bench_td_cook.py --transport cuda-ipc --config wan2.1-1.3b --warmup-s 30
On cuda-ipc the cook only queues its copies where TouchDesigner's calls take the component's stream;
`--streamless` stands in for a build whose calls take none, where each cook waits for the bridge's copies
(the two ways side by side). Beside the cook times: the engine's output rate and the outputs it dropped for
want of a free output slot (slots the host had not handed back yet).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom_live.host_bridge.wire import handoff_marks  # noqa: E402
from tests.fakes.touchdesigner import (  # noqa: E402
    CUDAMemoryShape,
    InputTOP,
    ScriptTOP,
    configure,
    make_component,
    running,
    td_texture,
)

TARGET_MS = {"shm": 6.0, "cuda-ipc": 1.0}
WARMUP_S = 1.0


class HostTOP(InputTOP):
    """numpyArray(delayed=True) as TD hands it out (float32 RGBA 0..1, bottom-up), two frames alternating."""

    def __init__(self, w: int, h: int) -> None:
        super().__init__(td_texture(h, w))
        self._frames = [td_texture(h, w, np.float32, seed=s) for s in (1, 2)]
        self._n = 0

    def numpyArray(self, delayed: bool = False, writable: bool = False) -> np.ndarray:
        self._n += 1
        return self._frames[self._n % 2]


class DeviceTOP(InputTOP):
    """cudaMemory() on two uint8 BGRA textures kept in device memory (TD's own copy is not counted)."""

    def __init__(self, w: int, h: int) -> None:
        from cuda.bindings import runtime as cudart

        from loom_live.host_bridge.wire.rings.cuda import check

        super().__init__(td_texture(h, w))
        self._ptrs = []
        for seed in (1, 2):
            data = td_texture(h, w, seed=seed)
            ptr = int(check(cudart.cudaMalloc(data.nbytes), "cudaMalloc"))
            check(cudart.cudaMemcpy(ptr, data.ctypes.data, data.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice),
                  "cudaMemcpy")
            self._ptrs.append(ptr)
        self._shape = CUDAMemoryShape(w, h, 4, np.uint8)
        self._n = 0

    def cudaMemory(self, stream: int | None = None) -> Any:
        self._n += 1
        ptr = self._ptrs[self._n % 2]
        return type("Mem", (), {"ptr": ptr, "size": self._shape.width * self._shape.height * 4,
                                "shape": self._shape})()

    def end_cook(self) -> None:
        """The textures live for the whole run."""


class StreamlessDeviceTOP(DeviceTOP):
    """A TouchDesigner build whose cudaMemory() takes no stream (its copy on the default stream)."""

    def cudaMemory(self) -> Any:
        return super().cudaMemory()


class BenchScriptTOP(ScriptTOP):
    """Takes the output as TD would, without counting TD's upload."""

    def copyNumpyArray(self, array: np.ndarray) -> None:
        self.output = array

    def copyCUDAMemory(self, address: int, size: int, shape: CUDAMemoryShape, stream: int | None = None) -> None:
        self.output = (address, size)


def model_config(preset: str, folder: Path) -> Path:
    """A config file of `preset` on random weights (what `loom bench` runs), for the component's Config."""
    import yaml

    from loom_live.engine.config import RANDOM_WEIGHTS, list_presets, overridden_source

    if preset not in list_presets():
        raise SystemExit(f"bench_td_cook: --config {preset!r}: expected one of {', '.join(list_presets())}")
    data = overridden_source(preset, RANDOM_WEIGHTS)[0]
    path = folder / f"{preset}-random.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(transport: str, w: int, h: int, seconds: float, fps: float, config: Path | None = None,
        warmup_s: float = WARMUP_S, start_s: float = 120.0, streamless: bool = False) -> dict[str, Any]:
    if transport != "cuda-ipc":
        source = HostTOP(w, h)
    else:
        source = StreamlessDeviceTOP(w, h) if streamless else DeviceTOP(w, h)
    comp, _, ext = make_component(source)
    script = BenchScriptTOP(comp, source)
    configure(comp, transport=transport)
    if config is not None:  # a model engine instead of the pass-through one
        comp.parexec_enabled = False
        comp.par.Config = str(config)
        comp.par.Passthrough = False
        comp.parexec_enabled = True
    comp.par.Active = True
    try:
        deadline = time.monotonic() + start_s
        while not running(comp):
            # an engine that cannot come (refused before launch, or dead) fails the run now, not at the deadline
            state = comp.par.State.eval()
            if state == "dead" or (state == "error" and ext.bridge is None) or time.monotonic() > deadline:
                raise RuntimeError(f"engine not running: {state} {comp.par.Message.eval()}")
            _cook(ext, script)
            time.sleep(0.02)
        if transport == "cuda-ipc" and ext.cuda_submits == 0:
            raise RuntimeError(f"cuda-ipc not in use: {comp.par.Message.eval()}")
        durations, fresh, period = [], [], 1.0 / fps
        start = time.monotonic()
        counted_from = start + warmup_s
        received0 = None
        next_at = start
        while time.monotonic() < counted_from + seconds:
            before = ext._host_output_of
            t = _cook(ext, script)
            if time.monotonic() >= counted_from:
                # a cook that showed a new engine frame (at 60 engine FPS every cook does); cuda-ipc copies every cook
                fresh.append(transport == "cuda-ipc" or ext._host_output_of is not before)
                if received0 is None:
                    received0, t0 = ext.bridge.stats()["received"], time.monotonic()
                    engine0 = ext.bridge.engine_report(refresh=True)
                durations.append(t * 1000.0)
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))
        elapsed = time.monotonic() - t0
        received = ext.bridge.stats()["received"] - received0
        engine1 = ext.bridge.engine_report(refresh=True)
        message = comp.par.Message.eval()
    finally:
        comp.par.Active = False
        ext.WaitClosed(20)
    d = np.asarray(durations)
    new = d[np.asarray(fresh, bool)]
    return {"transport": transport, "size": f"{w}x{h}", "cooks": len(d), "paced_fps": fps,
            "cook_ms": _stats(d), "new_frame_cooks": len(new), "new_frame_cook_ms": _stats(new),
            "engine_fps": round(received / elapsed, 1), "target_ms": TARGET_MS[transport],
            "engine_frames_out": _grew(engine0, engine1, "frames_out"),
            "engine_dropped_out": _grew(engine0, engine1, "dropped_out"),
            "engine_dropped_out_no_slot": _grew(engine0, engine1, "dropped_out_no_slot"),
            "engine_dropped_out_behind": _grew(engine0, engine1, "dropped_out_behind"),
            "engine_out_late": _grew(engine0, engine1, "out_late"),
            "engine_time_ms_per_frame": _time_per_frame(engine0, engine1),
            "cook_queues": ext.queues_copies, "message": message}


def _grew(before: dict[str, Any], after: dict[str, Any], key: str) -> int | None:
    """How much an engine counter grew over the measured time (None: the engine does not report it)."""
    if key not in before or key not in after:
        return None
    return int(after[key]) - int(before[key])


def _time_per_frame(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float] | None:
    """The engine worker's milliseconds a frame taken, per part, over the measured time (None: not reported)."""
    frames = _grew(before, after, "frames_in")
    if not frames or "time_ms" not in before or "time_ms" not in after:
        return None
    return {part: round((after["time_ms"][part] - ms) / frames, 3) for part, ms in before["time_ms"].items()}


def _costliest_calls(marks: Path, keep: int = 8) -> list[dict[str, Any]]:
    """The engine's timed CUDA runtime calls over its whole run, the most time in total first."""
    rows = [row for dump in handoff_marks.load_dumps(marks, "engine")
            for row in handoff_marks.call_table(dump["calls"], range(-1, 2**63))]
    for row in rows:
        row["total_ms"] = round(row["mean_us"] * row["n"] / 1000.0, 3)
    return sorted(rows, key=lambda r: -r["total_ms"])[:keep]


def _stats(d: np.ndarray) -> dict[str, float]:
    if not len(d):
        return {}
    return {k: round(float(v), 3) for k, v in (("p50", np.percentile(d, 50)), ("p90", np.percentile(d, 90)),
                                                ("p99", np.percentile(d, 99)), ("max", d.max()), ("mean", d.mean()))}


def _cook(ext: Any, script: ScriptTOP) -> float:
    script.cooking = True
    t = time.perf_counter()
    try:
        ext.Cook(script)
    finally:
        script.cooking = False
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transport", choices=("shm", "cuda-ipc"), default="shm")
    ap.add_argument("--size", default="1920x1080", help="WxH")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured time after the warm-up")
    ap.add_argument("--fps", type=float, default=60.0, help="cook rate, as TouchDesigner's frame loop")
    ap.add_argument("--config", default=None, metavar="PRESET",
                    help="a model engine of this preset on random weights instead of the pass-through engine")
    ap.add_argument("--warmup-s", type=float, default=WARMUP_S,
                    help="seconds of cooks after the engine's first output that are not counted (a model engine "
                         "compiles its first chunk shapes there)")
    ap.add_argument("--start-s", type=float, default=120.0, help="wait this long for the engine's first output")
    ap.add_argument("--streamless", action="store_true",
                    help="cuda-ipc: a TD build whose calls take no stream (each cook waits for the bridge's copies)")
    ap.add_argument("--calls", action="store_true",
                    help="also time the engine's CUDA runtime calls on its rings and list the costliest")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    if args.warmup_s < 0 or args.seconds <= 0 or args.start_s <= 0:
        ap.error("--warmup-s must be >= 0, --seconds and --start-s > 0")
    try:
        w, h = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        ap.error(f"--size: {args.size!r} is not WxH, e.g. 1920x1080")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    with tempfile.TemporaryDirectory(prefix="loom-td-cook-") as folder:
        config = model_config(args.config, Path(folder)) if args.config else None
        if args.calls:  # the engine inherits the setting and writes its calls there when it exits
            handoff_marks.enable(Path(folder) / "marks")
        result = run(args.transport, w, h, args.seconds, args.fps, config, args.warmup_s, args.start_s,
                     args.streamless)
        if args.calls:
            result["engine_calls"] = _costliest_calls(Path(folder) / "marks")
    result["engine"] = f"{args.config} on random weights" if args.config else "pass-through"
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in load],
                         "loadavg_after": [round(x, 2) for x in (os.getloadavg() if hasattr(os, "getloadavg")
                                                                 else load)]}
    way = ("copies queued" if result["cook_queues"] else "copies waited for") if args.transport == "cuda-ipc" else ""
    print(f"\nLoom TD operator, main-thread time per cook ({result['transport']}{', ' + way if way else ''}, "
          f"{result['engine']}, {result['size']}, "
          f"paced at {args.fps:g} FPS; {os.cpu_count()} CPUs, load {load[0]:.1f})")
    print(f"{'cooks':>22} {'n':>5} {'p50 ms':>8} {'p90':>8} {'p99':>8} {'max':>8} {'mean':>8} {'engine FPS':>11} "
          f"{'out / dropped':>14} {'target':>7}")
    out = f"{result['engine_frames_out']} / {result['engine_dropped_out']}"
    for label, key, n in (("all", "cook_ms", result["cooks"]),
                          ("with a new engine frame", "new_frame_cook_ms", result["new_frame_cooks"])):
        c = result[key]
        if c:
            print(f"{label:>22} {n:5d} {c['p50']:8.2f} {c['p90']:8.2f} {c['p99']:8.2f} {c['max']:8.2f} "
                  f"{c['mean']:8.2f} {result['engine_fps']:11.1f} {out:>14} {result['target_ms']:6.1f}")
    if result["engine_dropped_out"] or result["engine_out_late"]:
        print(f"engine outputs dropped: {result['engine_dropped_out_no_slot']} with no output slot free (the host's "
              f"reads), {result['engine_dropped_out_behind']} behind their pace (the paced queue full); "
              f"{result['engine_out_late']} sent over a pace step after they fell due (together with the next)")
    t = result["engine_time_ms_per_frame"]
    if t and any(t.values()):  # a pass-through engine copies slot to slot, outside these parts
        print(f"engine worker per frame taken: read {t['read']:.2f} ms, session calls {t['session']:.2f} ms (of which "
              f"waiting for the GPU {t['waiting']:.2f}), sending outputs {t['emit']:.2f} ms (of which writing them "
              f"into their slots {t['write']:.2f})")
    for row in result.get("engine_calls", []):
        print(f"engine CUDA call {row['call']:<48} n {row['n']:6d}  p50 {row['p50_us']:8.1f} us  p99 "
              f"{row['p99_us']:8.1f}  total {row['total_ms']:8.1f} ms")
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
