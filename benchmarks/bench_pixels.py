"""What a host frame's conversion costs on the CPU, in each host layout, with OpenCV and with numpy alone.

On shm and tcp every frame a host submits becomes the engine's uint8 RGB top-down (`pixels.to_engine`, or
`from_touchdesigner` for TouchDesigner's `numpyArray()`), and every output frame the host's layout
(`pixels.from_engine`, on the engine's side). A host's own Python may lack OpenCV (TouchDesigner's), so both
forms are timed.

    python benchmarks/bench_pixels.py [--size 1920x1080] [--repeats 20] [--json out/pixels.json]
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

from loom_live.engine.tools.bridge_probe import percentiles  # noqa: E402
from loom_live.host_bridge.wire import pixels  # noqa: E402
from loom_live.host_bridge.wire.files import write_replacing  # noqa: E402

# (name, direction, dtype, channels, order, bottom-up): the layouts hosts hand over
CASES = [
    ("RGB uint8 (player, scripts)", "in", "uint8", 3, "RGB", False),
    ("RGBA uint8 (scripts, NDI)", "in", "uint8", 4, "RGBA", False),
    ("TouchDesigner BGRA uint8", "in", "uint8", 4, "BGRA", True),
    ("TouchDesigner RGBA float32", "in", "float32", 4, "RGBA", True),
    ("ComfyUI RGB float32", "in", "float32", 3, "RGB", False),
    ("out: TouchDesigner BGRA uint8", "out", "uint8", 4, "BGRA", True),
    ("out: TouchDesigner RGBA float32", "out", "float32", 4, "RGBA", True),
]


def _frame(w: int, h: int, dtype: str, channels: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if dtype == "float32":
        return rng.random((h, w, channels), dtype=np.float32)
    return rng.integers(0, 256, (h, w, channels), dtype=np.uint8)


def time_case(w: int, h: int, case: tuple, repeats: int) -> dict:
    _, direction, dtype, channels, order, bottom_up = case
    if direction == "in":
        frame = _frame(w, h, dtype, channels)
        convert = lambda: pixels.to_engine(frame, order=order, bottom_up=bottom_up)  # noqa: E731
    else:
        rgb = _frame(w, h, "uint8", 3)
        convert = lambda: pixels.from_engine(rgb, channels=channels, dtype=dtype, order=order,  # noqa: E731
                                             bottom_up=bottom_up)
    convert()  # first call: imports, allocator
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        convert()
        samples.append(time.perf_counter() - t0)
    return percentiles(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1920x1080", help="WxH (default 1920x1080)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    w, h = (int(v) for v in args.size.lower().split("x"))
    opencv = pixels._opencv
    results: dict = {"size": args.size, "repeats": args.repeats, "cases": {}}
    for form, provider in (("opencv", opencv), ("numpy", lambda: None)):
        if form == "opencv" and opencv() is None:
            continue
        pixels._opencv = provider
        try:
            for case in CASES:
                results["cases"].setdefault(case[0], {})[form] = time_case(w, h, case, args.repeats)
        finally:
            pixels._opencv = opencv
    print(f"\nframe conversions at {args.size}, {args.repeats} repeats (ms; p50 / p99)")
    print(f"{'layout':>32} {'opencv p50':>11} {'p99':>7} {'numpy p50':>10} {'p99':>7}")
    for name, forms in results["cases"].items():
        cols = "".join(f" {forms[f]['p50_ms']:10.2f} {forms[f]['p99_ms']:7.2f}" if f in forms
                       else f" {'-':>10} {'-':>7}" for f in ("opencv", "numpy"))
        print(f"{name:>32}{cols}")
    if args.json:  # whole or not at all: an earlier result stays until this one is written
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_replacing(args.json, lambda f: f.write(json.dumps(results, indent=2).encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
