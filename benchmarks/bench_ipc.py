"""Bridge handoff overhead per frame: host -> engine -> host, against a plain device copy of the same bytes.

The engine runs `loom serve --passthrough` in its own process, so the measured time is only the
bridge: the host's copy into an input slot, the notice, the engine's slot-to-slot copy, the notice
back, and the host's copy out of the output slot. Baseline: one device-to-device copy of the same
bytes (what an in-process pipeline would pay at minimum).

Back to back, each frame is submitted as soon as the previous one is back. With `--fps N` each size is
also measured as a host frame loop would use the bridge, one frame every 1/N s: the engine then waits
idle between frames, so its wake-up is part of the time.

GPU machine (cuda-ipc, torch or cupy for allocation):
    python benchmarks/bench_ipc.py --frames 1000 --fps 60 --json out/bench_ipc.json
Any machine (shm transport, numpy RGBA host frames, which the bridge hands over as RGB):
    python benchmarks/bench_ipc.py --transport shm --size 1920x1080 --frames 300 --fps 60
CPU smoke run (shm transport, tiny frames):
    python benchmarks/bench_ipc.py --smoke --json /tmp/bench_ipc.json

`--queued` (cuda-ipc): the host's two copies queued on a stream of the caller's own, as the TouchDesigner
operator queues them (`submit_cuda(..., keep=)`, `latest_cuda(..., wait=False)`), the handoff done once that
stream has run them: the same frame in the caller's buffer, without the bridge's two waits for the GPU.

`--breakdown` also says where each handoff's time goes: both processes stamp each frame's steps
(`host_bridge.wire.handoff_marks`) and time every CUDA runtime call of the rings, and the tables give
each step's and each call's median and p99 (the stamping itself adds a few microseconds per frame).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom_live.engine.tools.bridge_probe import QueuedCopies, handoff_device, handoff_host, percentiles  # noqa: E402
from loom_live.host_bridge import Bridge, BridgeConfig  # noqa: E402
from loom_live.host_bridge.wire import handoff_marks  # noqa: E402
from loom_live.host_bridge.wire.cpu_awake import CpuAwake, idle_states  # noqa: E402

SIZES = {"512x512": (512, 512), "1920x1080": (1920, 1080)}
SMOKE_SIZES = {"64x48": (64, 48), "128x96": (128, 96)}


class DeviceBuffers:
    """RGBA uint8 frames in device memory through torch (or cupy), plus the plain-copy baseline."""

    def __init__(self, w: int, h: int):
        try:
            import torch
            self.lib = "torch"
            self.src = torch.randint(0, 256, (h, w, 4), dtype=torch.uint8, device="cuda")
            self.dst = torch.empty_like(self.src)
            self._sync = torch.cuda.synchronize
            self._copy = lambda: self.dst.copy_(self.src)
            self.src_ptr, self.dst_ptr = self.src.data_ptr(), self.dst.data_ptr()
            stream = torch.cuda.Stream()
        except ImportError:
            import cupy
            self.lib = "cupy"
            self.src = cupy.random.randint(0, 256, (h, w, 4), dtype=cupy.uint8)
            self.dst = cupy.empty_like(self.src)
            self._sync = cupy.cuda.Device().synchronize
            self._copy = lambda: self.dst.__setitem__(Ellipsis, self.src)
            self.src_ptr, self.dst_ptr = self.src.data.ptr, self.dst.data.ptr
            stream = cupy.cuda.Stream(non_blocking=True)
        self.pitch = w * 4
        handle = stream.cuda_stream if self.lib == "torch" else stream.ptr
        self.queued = QueuedCopies(handle, self.src, stream.synchronize)  # --queued: the caller's own stream
        self._sync()  # the random fill must be done before the first handoff reads it

    def copy_once(self) -> float:
        self._sync()
        t0 = time.perf_counter()
        self._copy()
        self._sync()
        return time.perf_counter() - t0

    def equal(self) -> bool:
        return bool((self.src == self.dst).all())


def copies_floor_gpu(buf: DeviceBuffers, w: int, h: int, frames: int) -> dict:
    """The bridge's five GPU copies in one process, no messages: caller -> staging -> input slot ->
    output slot -> newest-output buffer -> caller. The handoff minus this is messaging and threads."""
    from loom_live.host_bridge.wire.rings import create_ring

    rings = [create_ring("cuda-ipc", d, slots=n, width=w, height=h, channels=4)
             for d, n in (("in", 1), ("in", 3), ("out", 3), ("out", 1))]
    staging, ring_in, ring_out, newest = rings
    samples = []
    for _ in range(frames):
        t0 = time.perf_counter()
        staging.write_device(0, buf.src_ptr, buf.pitch)
        staging.copy_to(0, ring_in, 0)
        ring_in.copy_to(0, ring_out, 0)
        ring_out.copy_to(0, newest, 0)
        newest.read_device(0, buf.dst_ptr, buf.pitch)
        samples.append(time.perf_counter() - t0)
    for r in rings:
        r.close()
    return percentiles(samples)


def bench_gpu(bridge: Bridge, w: int, h: int, frames: int, warmup: int, paced: tuple[int, float, bool],
              queued: bool = False) -> dict:
    buf = DeviceBuffers(w, h)
    on = buf.queued if queued else None
    seqs = {}
    with _seqs(bridge, warmup, seqs, "handoff"):
        handoff = handoff_device(bridge, buf.src_ptr, buf.dst_ptr, buf.pitch, w, h, 4, "uint8", frames, warmup,
                                 queued=on)
    assert buf.equal(), "round trip changed the frame"
    out = {"handoff": handoff, "seqs": seqs}
    if paced[0]:
        with _seqs(bridge, warmup, seqs, "handoff_paced"):
            out["handoff_paced"] = handoff_device(bridge, buf.src_ptr, buf.dst_ptr, buf.pitch, w, h, 4, "uint8",
                                                  paced[0], warmup, period_s=paced[1], busy=paced[2], queued=on)
    baseline = [buf.copy_once() for _ in range(frames)]
    return {**out, "device_copy": percentiles(baseline),
            "copies_floor": copies_floor_gpu(buf, w, h, frames), "alloc": buf.lib, "bytes": w * h * 4}


def bench_cpu(bridge: Bridge, w: int, h: int, frames: int, warmup: int, paced: tuple[int, float, bool]) -> dict:
    src = np.random.default_rng(0).integers(0, 256, (h, w, 4), dtype=np.uint8)  # RGBA, as hosts hand it
    seqs = {}
    with _seqs(bridge, warmup, seqs, "handoff"):
        handoff, out = handoff_host(bridge, src, frames, warmup)
    assert np.array_equal(out, src[:, :, :3]), "round trip changed the frame"
    result = {"handoff": handoff, "seqs": seqs}
    if paced[0]:
        with _seqs(bridge, warmup, seqs, "handoff_paced"):
            result["handoff_paced"] = handoff_host(bridge, src, paced[0], warmup, period_s=paced[1],
                                                   busy=paced[2])[0]
    baseline = []
    for _ in range(frames):
        c0 = time.perf_counter()
        np.copyto(np.empty_like(src), src)
        baseline.append(time.perf_counter() - c0)
    return {**result, "host_copy": percentiles(baseline),
            "copies_floor": copies_floor_shm(src, frames), "bytes": src.nbytes}


def copies_floor_shm(src: np.ndarray, frames: int) -> dict:
    """The shm path's copies in one process, no messages: into the input slot, slot to slot, out."""
    from loom_live.host_bridge.wire.rings import attach_ring, create_ring

    h, w, _ = src.shape
    src = np.ascontiguousarray(src[:, :, :3])  # the engine's RGB, as `submit` makes it
    ring_in, ring_out = (create_ring("shm", d, slots=3, width=w, height=h) for d in ("in", "out"))
    peer_in, peer_out = attach_ring(ring_in.spec), attach_ring(ring_out.spec)
    samples = []
    for _ in range(frames):
        t0 = time.perf_counter()
        ring_in.write(0, src)
        peer_in.copy_to(0, peer_out, 0)  # what the pass-through engine does
        ring_out.read(0, [])
        samples.append(time.perf_counter() - t0)
    for r in (peer_in, peer_out, ring_in, ring_out):
        r.close()
    return percentiles(samples)


class _seqs:
    """Notes the sequence numbers of a run's measured frames (after its warm-up) under `key`."""

    def __init__(self, bridge: Bridge, warmup: int, into: dict, key: str):
        self.bridge, self.warmup, self.into, self.key = bridge, warmup, into, key

    def __enter__(self) -> None:
        self.first = self.bridge.last_seq + 1 + self.warmup

    def __exit__(self, *exc: object) -> None:
        self.into[self.key] = [self.first, self.bridge.last_seq]


def breakdown(results: dict, marks_dir: Path) -> dict:
    """Per size and run: each step's time (both processes' stamps merged per frame) and each CUDA call's."""
    host = handoff_marks.MARKS.as_dict()
    engines = handoff_marks.load_dumps(marks_dir, "engine")
    engine = engines[-1] if engines else {"frames": {}, "calls": {}}
    frames = handoff_marks.merge_frames(host["frames"], engine["frames"])
    out: dict = {"engine_stamps": bool(engines)}
    for name, r in results["sizes"].items():
        for run, (first, last) in r["seqs"].items():
            seqs = range(first, last + 1)
            picked = [frames[str(q)] for q in seqs if str(q) in frames]
            out[f"{name} {run}"] = {
                "steps": handoff_marks.step_table(picked, list(handoff_marks.HANDOFF_PATH)),
                "aside": [row for a, b in handoff_marks.ASIDE for row in handoff_marks.step_table(picked, [a, b])],
                "host_calls": handoff_marks.call_table(host["calls"], seqs),
                "engine_calls": handoff_marks.call_table(engine["calls"], seqs),
            }
    return out


def print_breakdown(parts: dict) -> None:
    if not parts["engine_stamps"]:
        print("\n(no engine stamps came back: the engine did not exit cleanly; host steps only)")
    for run, tables in parts.items():
        if run == "engine_stamps":
            continue
        print(f"\nwhere the handoff goes, {run} (us; a step runs from its point to the next)")
        print(f"{'step':>44} {'p50':>9} {'p99':>9} {'n':>6}")
        for row in tables["steps"]:
            print(f"{row['step']:>44} {row['p50_us']:9.1f} {row['p99_us']:9.1f} {row['n']:6d}")
        total = sum(row["p50_us"] for row in tables["steps"])
        print(f"{'sum of the medians':>44} {total:9.1f}")
        for row in tables["aside"]:
            print(f"{'(beside it) ' + row['step']:>44} {row['p50_us']:9.1f} {row['p99_us']:9.1f} {row['n']:6d}")
        for side in ("host_calls", "engine_calls"):
            if tables[side]:
                print(f"{side.replace('_', ' ') + ' (step, CUDA call)':>44}")
            for row in tables[side]:
                print(f"{row['call']:>44} {row['p50_us']:9.1f} {row['p99_us']:9.1f} {row['n']:6d}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU run over shm with tiny frames")
    ap.add_argument("--transport", choices=("cuda-ipc", "shm"), default=None,
                    help="cuda-ipc: device buffers (default); shm: host arrays (the default with --smoke)")
    ap.add_argument("--size", action="append", default=None,
                    help=f"measure only this size (repeatable); one of {', '.join(SIZES)} (smoke: "
                         f"{', '.join(SMOKE_SIZES)})")
    ap.add_argument("--frames", type=int, default=None, help="measured frames per size (default 1000, smoke 50)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--fps", type=float, default=0.0, help="also measure a frame every 1/FPS s (a host frame loop)")
    ap.add_argument("--paced-frames", type=int, default=300, help="measured frames per size at --fps")
    ap.add_argument("--busy-host", action="store_true",
                    help="at --fps the host busy-waits between frames instead of sleeping (a loop that keeps its "
                         "core working, as a renderer's does)")
    ap.add_argument("--hold-cpu-awake", action="store_true",
                    help="hold the CPUs' wake-up latency limit at 0 for the run (/dev/cpu_dma_latency: no deep idle "
                         "states between paced frames); said when it cannot be held")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--queued", action="store_true",
                    help="cuda-ipc: the host's copies queued on a stream of the caller's own, as TouchDesigner's")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each step and CUDA call of a handoff in both processes (median, p99)")
    args = ap.parse_args()
    if args.fps < 0 or args.paced_frames < 1:
        ap.error("--fps must be >= 0 and --paced-frames >= 1")
    paced = (args.paced_frames, 1.0 / args.fps, args.busy_host) if args.fps else (0, 0.0, False)
    frames = args.frames or (50 if args.smoke else 1000)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    unknown = sorted(set(args.size or ()) - set(sizes))
    if unknown:
        ap.error(f"--size {', '.join(unknown)}: expected one of {', '.join(sizes)}")
    sizes = {name: wh for name, wh in sizes.items() if not args.size or name in args.size}
    transport = args.transport or ("shm" if args.smoke else "cuda-ipc")
    if args.smoke and transport != "shm":
        ap.error("--smoke runs over shm; leave out --transport or give --transport shm")
    if args.queued and transport != "cuda-ipc":
        ap.error("--queued queues the host's device copies: it needs --transport cuda-ipc")
    marks_dir = None
    if args.breakdown:  # before the engine starts: it inherits the setting
        marks_dir = Path(tempfile.mkdtemp(prefix="loom-handoff-"))
        handoff_marks.enable(marks_dir)
        from loom_live.host_bridge.wire.rings import cuda as cuda_rings
        cuda_rings.time_calls()
    cfg = BridgeConfig(transport=transport, passthrough=True, engine_cwd=str(ROOT))
    results: dict = {"transport": transport, "frames": frames, "fps": args.fps, "paced_frames": paced[0],
                     "busy_host": paced[2], "queued": args.queued, "sizes": {}}
    awake = CpuAwake().hold() if args.hold_cpu_awake else None
    if awake is not None and not awake.held:
        print(f"--hold-cpu-awake: {awake.why}")
    results["cpu_awake"] = {"asked": awake is not None, "held": bool(awake and awake.held),
                            "why": awake.why if awake else "", "idle": idle_states()}
    with Bridge(cfg) as bridge:
        bridge.wait_running(60)
        for name, (w, h) in sizes.items():
            if transport == "shm":
                results["sizes"][name] = bench_cpu(bridge, w, h, frames, args.warmup, paced)
            else:
                results["sizes"][name] = bench_gpu(bridge, w, h, frames, args.warmup, paced, args.queued)
        results["bridge_stats"] = bridge.stats()
    if awake is not None:
        awake.close()
    if marks_dir is not None:  # the engine wrote its stamps as it exited
        results["breakdown"] = breakdown(results, marks_dir)
    base_key = "host_copy" if transport == "shm" else "device_copy"
    how = ", the host's copies queued" if args.queued else ""
    print(f"\nbridge handoff host->engine->host ({transport}{how}, pass-through engine, {frames} frames)")
    paced_head = f" {f'@{args.fps:g}fps p50':>12} {'p99':>9}" if paced[0] else ""
    print(f"{'size':>10} {'handoff p50':>12} {'p99':>9}{paced_head} {base_key + ' p50':>16} {'p99':>9} "
          f"{'copies p50':>11} {'p99':>9}  (ms)")
    for name, r in results["sizes"].items():
        paced_cols = f" {r['handoff_paced']['p50_ms']:12.3f} {r['handoff_paced']['p99_ms']:9.3f}" if paced[0] else ""
        print(f"{name:>10} {r['handoff']['p50_ms']:12.3f} {r['handoff']['p99_ms']:9.3f}{paced_cols} "
              f"{r[base_key]['p50_ms']:16.4f} {r[base_key]['p99_ms']:9.4f} "
              f"{r['copies_floor']['p50_ms']:11.4f} {r['copies_floor']['p99_ms']:9.4f}")
    print("handoff: submit -> output back in the caller's buffer through a pass-through engine process, back to "
          f"back{f' and one frame every {1000 / args.fps:.1f} ms' if paced[0] else ''}; "
          f"{base_key}: one copy of the same bytes; copies: the bridge's own copies without messaging")
    if marks_dir is not None:
        print_breakdown(results["breakdown"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
