"""Recovery of a show: start to the first restyled frame, and SIGKILL of the engine to the next one.

A host loop submits frames at `--fps` and reads `latest()` as a show would, against a launched
engine behind the bridge, in three modes: `restart` (the supervisor starts a new engine after a
crash; its compiled kernels come from the persistent Inductor cache), `standby` (a second engine
is kept loaded and warmed, and takes over at once; launched beside the first, the default) and
`standby-after` (the same, the standby launched once the first serves). For each mode: seconds
from `start()` to the first fresh output, then `--kills` times: seconds from SIGKILL of the engine in use to the first
fresh output of its successor, and the longest host call meanwhile; in the standby modes also the seconds
from `start()` until the standby first said ready (both engines ready). Prints one table, then each
serving engine's start-up line (where its start-up went, and how long its process ran before); `--json`
writes the same. Needs a GPU for the default preset; Linux (SIGKILL).

    python benchmarks/bench_recovery.py --json out/recovery.json        # wan2.1-1.3b, cuda-ipc, restart and standby
    python benchmarks/bench_recovery.py --config default --transport shm --passthrough --kills 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from loom_live.engine.config import RANDOM_WEIGHTS  # noqa: E402
from loom_live.host_bridge import Bridge, BridgeConfig  # noqa: E402
from loom_live.plugin.media.generated_clip import generate_clip  # noqa: E402

STARTUP_LINE = re.compile(r"start-up \d.*")  # the engine's line on where its start-up went (engine/stream/startup.py)



SLOW_CALL_S = 0.005  # a host call this long is listed with when it came and what the bridge said then
SLOW_CALLS_KEPT = 8


class HostLoop:
    """Submit and read at a fixed rate, as a show's frame loop does; remembers its longest call, and its slow
    ones since `reset()` (which call, when, and the bridge's state then), to tell where a long one came from."""

    def __init__(self, bridge: Bridge, clip: list[np.ndarray], fps: float):
        self.bridge, self.clip, self.period = bridge, clip, 1.0 / fps
        self.i = 0
        self.reset()

    def reset(self) -> None:
        self.since = time.monotonic()
        self.longest_call_s = 0.0
        self.slow_calls: list[dict] = []
        self.read_s: list[float] = []  # every latest() since the reset: how often the host's read waited
        self.fresh = 0  # restyled frames the host's reads found new since the reset
        self._seen = -1

    def _timed(self, name: str, call):
        t = time.monotonic()
        result = call()
        took = time.monotonic() - t
        if took >= SLOW_CALL_S and len(self.slow_calls) < SLOW_CALLS_KEPT:
            self.slow_calls.append({"call": name, "ms": round(took * 1000, 2),
                                    "at_s": round(t - self.since, 3), "state": self.bridge.status().state.value})
        return took, result

    def until(self, done, timeout_s: float) -> float | None:
        """Run the loop until `done(status)`; seconds taken, or None at the timeout."""
        start = next_frame = time.monotonic()
        while time.monotonic() - start < timeout_s:
            took_submit, _ = self._timed("submit", lambda: self.bridge.submit(self.clip[self.i % len(self.clip)]))
            took_latest, (_, status) = self._timed("latest", self.bridge.latest)
            self.read_s.append(took_latest)
            if not status.fallback and status.seq > self._seen:
                self.fresh, self._seen = self.fresh + 1, status.seq
            self.longest_call_s = max(self.longest_call_s, took_submit + took_latest)
            self.i += 1
            if done(status):
                return time.monotonic() - start
            next_frame += self.period
            time.sleep(max(0.0, next_frame - time.monotonic()))
        return None


MODES = ("restart", "standby", "standby-after")


def read_summary(read_s: list[float], fresh: int = 0) -> dict:
    """The host's reads over a span: how many, their median and 99th percentile, how many took 5 ms or more,
    and how many of them found a new restyled frame (the show's frame rate while a standby loads)."""
    if not read_s:
        return {"reads": 0, "p50_ms": None, "p99_ms": None, "slow": 0, "fresh": 0}
    ms = np.asarray(read_s) * 1000
    return {"reads": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3), "slow": int((ms >= SLOW_CALL_S * 1000).sum()),
            "fresh": fresh}


def startup_line(bridge: Bridge) -> str | None:
    """The serving engine's start-up line, from the last lines it printed (None if not among them)."""
    found = (STARTUP_LINE.search(line) for line in reversed(bridge.status().log_tail))
    return next((m.group(0) for m in found if m), None)


def run_mode(mode: str, args: argparse.Namespace, clip: list[np.ndarray]) -> dict:
    overrides = ([] if args.trained_weights else list(RANDOM_WEIGHTS)) + args.overrides
    cfg = BridgeConfig(transport=args.transport, engine_config=args.config, engine_overrides=overrides,
                       passthrough=args.passthrough, standby=mode.startswith("standby"),
                       standby_start="after" if mode == "standby-after" else "together",
                       engine_warmup=args.warmup, standby_warmup_share=args.standby_warmup_share,
                       restart_backoff_s=0.0,
                       handshake_timeout_s=120.0, load_timeout_s=args.timeout)
    row: dict = {"mode": mode, "kills": [], "startup_lines": []}
    bridge = Bridge(cfg)
    loop = HostLoop(bridge, clip, args.fps)
    t0 = time.monotonic()
    bridge.start()
    try:
        row["start_to_first_frame_s"] = loop.until(lambda s: not s.fallback, args.timeout)
        if row["start_to_first_frame_s"] is None:
            row["error"] = f"no restyled frame within {args.timeout:.0f} s: {bridge.status().message}"
            return row
        row["start_to_first_frame_s"] = round(time.monotonic() - t0, 2)
        row["startup_lines"].append(startup_line(bridge))
        for _ in range(args.kills):
            if mode.startswith("standby"):  # a kill before the standby is ready measures a restart, not the standby
                ready = loop.until(lambda s: (bridge.stats()["standby"] or {}).get("state") == "ready", args.timeout)
                if ready is None:
                    row["error"] = f"standby not ready within {args.timeout:.0f} s"
                    return row
                row.setdefault("start_to_standby_ready_s", round(time.monotonic() - t0, 2))
            loop.reset()
            loop.until(lambda s: False, args.steady_s)
            steady = read_summary(loop.read_s, loop.fresh)  # the reads beside a ready, idle standby (or none)
            pid = bridge.stats()["engine_pid"]
            loop.reset()
            os.kill(pid, signal.SIGKILL)
            took = loop.until(lambda s, old=pid: not s.fallback and bridge.stats()["engine_pid"] != old, args.timeout)
            kill = {"kill_to_frame_s": None if took is None else round(took, 2),
                    "longest_host_call_ms": round(loop.longest_call_s * 1000, 2), "slow_calls": loop.slow_calls,
                    "steady_reads": steady}
            row["kills"].append(kill)
            if mode.startswith("standby") and took is not None:  # the reads while the next standby loads beside
                loop.until(lambda s: (bridge.stats()["standby"] or {}).get("state") == "ready", args.timeout)
                kill["kill_to_standby_ready_s"] = round(time.monotonic() - loop.since, 2)
            kill["reads"] = read_summary(loop.read_s, loop.fresh)  # kill to next standby ready (restart: frame)
            row["startup_lines"].append(startup_line(bridge))
    finally:
        bridge.close()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="wan2.1-1.3b")
    ap.add_argument("--transport", default="cuda-ipc", choices=("cuda-ipc", "shm", "tcp"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--passthrough", action="store_true", help="engines return their input (a smoke run)")
    ap.add_argument("--trained-weights", action="store_true", help="load the checkpoints instead of random weights")
    ap.add_argument("--modes", default="restart,standby",
                    help="comma-separated: restart, standby (launched with the engine), standby-after (once it serves)")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--fps", type=float, default=30.0)
    ap.add_argument("--steady-s", type=float, default=5.0, help="frames before each kill")
    ap.add_argument("--size", default="832x480", help="host frame size WxH")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="engines warm up (compile, capture) before they say ready")
    ap.add_argument("--standby-warmup-share", type=float, default=BridgeConfig.standby_warmup_share,
                    help="the share of the time a standby launched beside a show warms up in (1: no rests)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - set(MODES):
        ap.error(f"--modes: {args.modes!r}; expected a comma-separated list of {', '.join(MODES)}")
    width, height = (int(v) for v in args.size.split("x"))
    clip = list(generate_clip(n_frames=48, size=(width, height), fps=args.fps))
    rows = [run_mode(mode, args, clip) for mode in modes]
    print(f"\nrecovery: {args.config} over {args.transport}, {args.size}, {args.kills} kills per mode")
    print(f"{'mode':16s} {'start->frame s':>15s} {'start->standby s':>17s} {'kill->frame s (each)':>28s} "
          f"{'longest host call ms':>22s}")
    for r in rows:
        kills = ", ".join("-" if k["kill_to_frame_s"] is None else f"{k['kill_to_frame_s']:.2f}" for k in r["kills"])
        longest = max((k["longest_host_call_ms"] for k in r["kills"]), default=0.0)
        start, both = (r.get(k) for k in ("start_to_first_frame_s", "start_to_standby_ready_s"))
        start, both = ("-" if v is None else f"{v:.2f}" for v in (start, both))
        print(f"{r['mode']:16s} {start:>15s} {both:>17s} {kills:>28s} {longest:>22.2f}"
              + (f"  ({r['error']})" if "error" in r else ""))
    for r in rows:  # where a kill's long host calls came: which call, seconds after the kill, the bridge's state
        for i, k in enumerate(r["kills"]):
            slow = ", ".join(f"{c['call']} {c['ms']:.1f} ms at {c['at_s']:.3f} s ({c['state']})"
                             for c in k.get("slow_calls", []))
            if slow:
                print(f"{r['mode']} kill {i + 1}: host calls over {SLOW_CALL_S * 1000:.0f} ms: {slow}")
            steady = k.get("steady_reads")
            if steady and steady["reads"]:
                print(f"{r['mode']} kill {i + 1}: latest() over the {args.steady_s:g} s before it: {steady['reads']} "
                      f"reads, p50 {steady['p50_ms']:.2f} ms, p99 {steady['p99_ms']:.2f} ms, {steady['slow']} over "
                      f"{SLOW_CALL_S * 1000:.0f} ms; {steady['fresh']} found a new restyled frame")
            reads, upto = k.get("reads"), k.get("kill_to_standby_ready_s")
            if reads and reads["reads"]:
                span = f"the next standby ready at {upto:.1f} s" if upto is not None else "the first frame"
                print(f"{r['mode']} kill {i + 1}: latest() from the kill to {span}: {reads['reads']} reads, "
                      f"p50 {reads['p50_ms']:.2f} ms, p99 {reads['p99_ms']:.2f} ms, {reads['slow']} over "
                      f"{SLOW_CALL_S * 1000:.0f} ms; {reads['fresh']} found a new restyled frame")
    for r in rows:  # the serving engine's own account, at its first frame and after each kill
        for i, line in enumerate(r["startup_lines"]):
            print(f"{r['mode']} engine {i}: {line or 'no start-up line in its last output'}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
