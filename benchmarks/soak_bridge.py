"""Soak test of the whole host path: a host frame loop against a launched engine for minutes.

What a show needs beyond a short test: memory flat in both processes, latency not drifting,
no restart, no fallback once running, however long the set. With `--refuse-every N` a careless
host's frames join the loop every N frames: a NaN frame and a frame of a shape no engine takes
(both refused by `submit()` and counted), and a frame larger than `max_frame_side` (shrunk on a bridge thread of the
host); every refusal must show in the bridge's counters and none may disturb the stream.
Prints one row per interval and a summary table; `--json` writes the same. Linux (reads /proc for
the processes' memory).

    python benchmarks/soak_bridge.py --minutes 5 --fps 30                  # embedded default, shm
    python benchmarks/soak_bridge.py --minutes 10 --transport cuda-ipc --config wan2.1-1.3b \\
        --set model.random_weights=true --set vae.random_weights=true --set prompt.encoder=hash
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from loom_live.host_bridge import Bridge, BridgeConfig  # noqa: E402
from loom_live.plugin.media.generated_clip import generate_clip  # noqa: E402


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of a process in MiB (None when it is gone or not on Linux)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, TypeError):
        return None
    return None


def careless_frames(height: int, width: int) -> list[np.ndarray]:
    """Frames a careless host sends: one holding NaN, one of five channels."""
    nan = np.full((height, width, 3), 0.5, np.float32)
    nan[height // 2, width // 2, 1] = np.nan
    return [nan, np.zeros((height, width, 5), np.uint8)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--fps", type=float, default=30.0, help="the host loop's rate")
    ap.add_argument("--interval", type=float, default=30.0, help="seconds per reported row")
    ap.add_argument("--transport", default="shm", choices=("shm", "cuda-ipc"))
    ap.add_argument("--config", default="default")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--size", default="256x256", help="host frame size WxH")
    ap.add_argument("--refuse-every", type=int, default=0, metavar="N",
                    help="every N frames also submit a NaN frame, a bad shape and an oversized frame (0: never)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    clip = list(generate_clip(n_frames=96, size=(width, height), fps=args.fps))
    cfg = BridgeConfig(transport=args.transport, engine_config=args.config, engine_overrides=args.overrides)
    rows, period = [], 1.0 / args.fps
    with Bridge(cfg) as bridge:
        bridge.wait_running(900)
        pid = bridge.stats()["engine_pid"]
        start = next_frame = mark = time.monotonic()
        i = fallbacks = slow_calls = injected = 0
        bad_frames = careless_frames(height, width)
        oversized = np.zeros((height * 3, cfg.max_frame_side + 1, 3), np.uint8)
        restyled = False  # fallbacks count once the first restyled frame has been shown
        while time.monotonic() - start < args.minutes * 60:
            t = time.monotonic()
            if args.refuse_every and i % args.refuse_every == args.refuse_every - 1:
                for bad in bad_frames:
                    try:
                        bridge.submit(bad)
                    except ValueError:
                        injected += 1
                bridge.submit(oversized)
            bridge.submit(clip[i % len(clip)])
            _, status = bridge.latest()
            slow_calls += time.monotonic() - t > period  # the host loop must never wait a frame
            restyled = restyled or not status.fallback
            fallbacks += restyled and status.fallback
            i += 1
            if time.monotonic() - mark >= args.interval:
                s = bridge.stats()
                rows.append({"t_s": round(time.monotonic() - start, 1), "submitted": i, "received": s["received"],
                             "fallbacks": fallbacks, "slow_host_calls": slow_calls, "restarts": s["restarts"],
                             "refused_injected": injected, "refused_frames": s["refused_frames"],
                             "refused_messages": s["refused"] + int(s["engine"].get("refused", 0)),
                             "latency_p50_ms": s["latency_ms_p50"], "latency_p99_ms": s["latency_ms_p99"],
                             "host_rss_mib": rss_mib(os.getpid()), "engine_rss_mib": rss_mib(pid)})
                print("  ".join(f"{k} {v}" for k, v in rows[-1].items()), flush=True)
                mark = time.monotonic()
            next_frame += period
            time.sleep(max(0.0, next_frame - time.monotonic()))
    first, last = rows[0], rows[-1]
    summary = {
        "minutes": args.minutes, "transport": args.transport, "config": args.config, "frames": i,
        "restarts": last["restarts"], "fallbacks_after_first_output": last["fallbacks"], "slow_host_calls": slow_calls,
        "host_rss_growth_mib": round(last["host_rss_mib"] - first["host_rss_mib"], 1),
        "engine_rss_growth_mib": (round(last["engine_rss_mib"] - first["engine_rss_mib"], 1)
                                  if last["engine_rss_mib"] is not None and first["engine_rss_mib"] is not None
                                  else None),
        "latency_p50_first_last_ms": [first["latency_p50_ms"], last["latency_p50_ms"]],
        "refused_frames_injected_counted": [last["refused_injected"], last["refused_frames"]],
        "refused_messages": last["refused_messages"],
    }
    print("\nsoak summary (memory growth from the first to the last interval)")
    for k, v in summary.items():
        print(f"  {k:28s} {v}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
