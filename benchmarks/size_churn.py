"""An input whose size changes every frame, then holds: how long the host sees no restyled frame.

A host frame loop at `--fps` submits frames of four sizes in turn for `--churn` seconds, then frames of
one size for `--after` seconds, through a launched engine (the embedded default unless `-c`), and notes
when each new restyled frame reaches `latest()`. Prints the restyled frames during and after the churn,
when the first came after it, and the longest stretch without one after it (issue 32: 12.6 s before
the bridge took a new size only once it held for a chunk of frames).

    python benchmarks/size_churn.py --churn 4 --after 20
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from loom_live.host_bridge import Bridge, BridgeConfig  # noqa: E402

SIZES = [(96, 128), (120, 160), (144, 192), (100, 100)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--churn", type=float, default=4.0, help="seconds of a new size every frame")
    p.add_argument("--after", type=float, default=20.0, help="seconds of one size afterwards")
    p.add_argument("--fps", type=float, default=30.0)
    p.add_argument("-c", "--config", default="default")
    args = p.parse_args()
    root = str(Path(__file__).resolve().parents[1])
    with Bridge(BridgeConfig(engine_cwd=root, engine_config=args.config)) as bridge:
        bridge.wait_running(300)
        t0, seen, i, last_seq = time.monotonic(), [], 0, -1
        while (t := time.monotonic() - t0) < args.churn + args.after:
            h, w = SIZES[i % len(SIZES)] if t < args.churn else SIZES[1]
            bridge.submit(np.full((h, w, 3), (i * 7) % 255, np.uint8))
            i += 1
            _, status = bridge.latest()
            if not status.fallback and status.seq != last_seq:
                last_seq = status.seq
                seen.append(t)
            time.sleep(1.0 / args.fps)
    after = [t for t in seen if t >= args.churn]
    gaps = np.diff([args.churn, *after, args.churn + args.after])
    print(f"restyled frames: {len(seen) - len(after)} during the churn, {len(after)} after it; first after it "
          f"{after[0] - args.churn:.2f} s after it ended; longest stretch without one after it {gaps.max():.2f} s"
          if after else f"restyled frames: {len(seen)} during the churn, none in the {args.after:g} s after it")


if __name__ == "__main__":
    main()
