"""What an idle link costs: CPU time of the engine process (and of this host process) while no frame flows.

A host keeps its engine running between shows, scenes and cooks, so an engine that polls while idle
burns a core's share all day. This launches a pass-through engine as a host would, hands it a few
frames (so its rings and frame path are set up as in use), then measures both processes' CPU time
over a window in which nothing is submitted.

    python benchmarks/bench_idle_cpu.py --transport shm --seconds 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom_live.host_bridge import Bridge, BridgeConfig  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process (Linux /proc, else psutil)."""
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        fields = stat.read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)
    import psutil  # not a dependency: only where /proc is missing

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transport", choices=("shm", "cuda-ipc", "tcp"), default="shm")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the idle window")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args()
    if args.seconds <= 0:
        ap.error("--seconds must be > 0")
    cfg = BridgeConfig(transport=args.transport, passthrough=True, engine_cwd=str(ROOT))
    frame = np.zeros((64, 64, 4), np.uint8)
    with Bridge(cfg) as bridge:
        bridge.wait_running(60)
        for _ in range(10):
            bridge.submit(frame)
            bridge.wait_for_output(bridge.last_seq, 10)
        time.sleep(1.0)  # past any "frames are flowing" window
        pid = bridge.stats()["engine_pid"]
        e0, h0, t0 = process_cpu_s(pid), time.process_time(), time.monotonic()
        time.sleep(args.seconds)
        e1, h1, t1 = process_cpu_s(pid), time.process_time(), time.monotonic()
    wall = t1 - t0
    result = {"transport": args.transport, "seconds": wall, "engine_cpu_pct": 100 * (e1 - e0) / wall,
              "host_cpu_pct": 100 * (h1 - h0) / wall}
    print(f"idle {args.transport} link over {wall:.1f} s: engine process {result['engine_cpu_pct']:.2f} % of a core, "
          f"host process {result['host_cpu_pct']:.2f} %")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
