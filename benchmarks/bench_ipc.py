"""Bridge handoff overhead per frame: host -> engine -> host, against a plain device copy of the same bytes.

The engine runs `loom serve --passthrough` in its own process, so the measured time is only the
bridge: the host's copy into an input slot, the notice, the engine's slot-to-slot copy, the notice
back, and the host's copy out of the output slot. Baseline: one device-to-device copy of the same
bytes (what an in-process pipeline would pay at minimum).

GPU machine (cuda-ipc, torch or cupy for allocation):
    python benchmarks/bench_ipc.py --json out/bench_ipc.json
CPU smoke run (shm transport, numpy, tiny frames):
    python benchmarks/bench_ipc.py --smoke --json /tmp/bench_ipc.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from host_bridge import Bridge, BridgeConfig  # noqa: E402

SIZES = {"512x512": (512, 512), "1920x1080": (1920, 1080)}
SMOKE_SIZES = {"64x48": (64, 48), "128x96": (128, 96)}


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = np.asarray(samples_s) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "n": len(ms)}


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
        except ImportError:
            import cupy
            self.lib = "cupy"
            self.src = cupy.random.randint(0, 256, (h, w, 4), dtype=cupy.uint8)
            self.dst = cupy.empty_like(self.src)
            self._sync = cupy.cuda.Device().synchronize
            self._copy = lambda: self.dst.__setitem__(Ellipsis, self.src)
            self.src_ptr, self.dst_ptr = self.src.data.ptr, self.dst.data.ptr
        self.pitch = w * 4

    def copy_once(self) -> float:
        self._sync()
        t0 = time.perf_counter()
        self._copy()
        self._sync()
        return time.perf_counter() - t0

    def equal(self) -> bool:
        return bool((self.src == self.dst).all())


def bench_gpu(bridge: Bridge, w: int, h: int, frames: int, warmup: int) -> dict:
    buf = DeviceBuffers(w, h)
    handoff, baseline = [], []
    for i in range(frames + warmup):
        t0 = time.perf_counter()
        bridge.submit_cuda(buf.src_ptr, buf.pitch, w, h, 4, "uint8")
        if not bridge.wait_for_output(bridge.last_seq, 10):
            raise RuntimeError(f"no output for frame {i}: {bridge.status()}")
        bridge.latest_cuda(buf.dst_ptr, buf.pitch)
        t1 = time.perf_counter()
        if i >= warmup:
            handoff.append(t1 - t0)
            baseline.append(buf.copy_once())
    assert buf.equal(), "round trip changed the frame"
    return {"handoff": _percentiles(handoff), "device_copy": _percentiles(baseline), "alloc": buf.lib,
            "bytes": w * h * 4}


def bench_cpu(bridge: Bridge, w: int, h: int, frames: int, warmup: int) -> dict:
    src = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    handoff, baseline = [], []
    out = None
    for i in range(frames + warmup):
        t0 = time.perf_counter()
        bridge.submit(src)
        if not bridge.wait_for_output(bridge.last_seq, 10):
            raise RuntimeError(f"no output for frame {i}: {bridge.status()}")
        out, _ = bridge.latest()
        t1 = time.perf_counter()
        if i >= warmup:
            handoff.append(t1 - t0)
            c0 = time.perf_counter()
            np.copyto(np.empty_like(src), src)
            baseline.append(time.perf_counter() - c0)
    assert np.array_equal(out, src), "round trip changed the frame"
    return {"handoff": _percentiles(handoff), "host_copy": _percentiles(baseline), "bytes": src.nbytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU run over shm with tiny frames")
    ap.add_argument("--frames", type=int, default=None, help="measured frames per size (default 1000, smoke 50)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args()
    frames = args.frames or (50 if args.smoke else 1000)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    transport = "shm" if args.smoke else "cuda-ipc"
    cfg = BridgeConfig(transport=transport, passthrough=True, engine_cwd=str(ROOT))
    results: dict = {"transport": transport, "frames": frames, "sizes": {}}
    with Bridge(cfg) as bridge:
        bridge.wait_running(60)
        for name, (w, h) in sizes.items():
            run = bench_cpu if args.smoke else bench_gpu
            results["sizes"][name] = run(bridge, w, h, frames, args.warmup)
        results["bridge_stats"] = bridge.stats()
    base_key = "host_copy" if args.smoke else "device_copy"
    print(f"\nbridge handoff host->engine->host ({transport}, pass-through engine, {frames} frames)")
    print(f"{'size':>10} {'handoff p50':>12} {'p99':>9} {base_key + ' p50':>16} {'p99':>9}  (ms)")
    for name, r in results["sizes"].items():
        print(f"{name:>10} {r['handoff']['p50_ms']:12.3f} {r['handoff']['p99_ms']:9.3f} "
              f"{r[base_key]['p50_ms']:16.4f} {r[base_key]['p99_ms']:9.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
