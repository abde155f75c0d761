"""A notice's round trip through the doorbell between two processes, without frames or copies.

What the doorbell itself adds to a frame (the wake-up of the waiting side, twice): this process
publishes a frame notice, an echo process answers it with a notice of its own, this process waits for
it. Back to back, and paced like a host's frame loop (one notice every 1/FPS s, so both sides fall
asleep in between). Also reports the echo process's CPU time per second during the paced run, which
is what a spin before sleeping costs.

    python benchmarks/bench_doorbell.py --notices 2000 --fps 60 --paced 300 [--spin-us 200] [--arrival-spin-us 300]

`--arrival-spin-us W`: both sides spin only within W us of the peer's predicted next paced notice
(`host_bridge/wire/arrival_spin.py`; the same as LOOM_DOORBELL_SPIN_US=W for a bridge and its engine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_idle_cpu import process_cpu_s  # noqa: E402
from loom_live.engine.tools.bridge_probe import percentiles  # noqa: E402
from loom_live.host_bridge.wire import doorbell as db  # noqa: E402
from loom_live.host_bridge.wire.arrival_spin import ENV  # noqa: E402
from loom_live.host_bridge.wire.cpu_awake import CpuAwake, idle_states  # noqa: E402
from loom_live.host_bridge.wire.shared_wait import backend  # noqa: E402

ECHO = textwrap.dedent("""
    import sys
    from loom_live.host_bridge.wire import doorbell as db
    db.SPIN_S = float(sys.argv[2])
    side = db.Doorbell.attach(sys.argv[1])
    print("ready", flush=True)
    running = True
    with side.lock:
        while running:
            for msg, _ in side.receive(1.0):
                running = msg["seq"] != 0
                side.send_frame(msg["slot"], msg["seq"], msg["gen"])
    side.close()
""")


def round_trips(bell: db.Doorbell, first_seq: int, count: int, period_s: float) -> list[float]:
    samples = []
    with bell.lock:
        for seq in range(first_seq, first_seq + count):
            t0 = time.perf_counter()
            bell.send_frame(0, seq, 1)
            while not bell.receive(5.0):
                pass
            samples.append(time.perf_counter() - t0)
            rest = period_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
    return samples


def child_env() -> dict[str, str]:
    """This process's environment with the checkout first on the path: the echo child must find the
    packages this Python finds (pyzmq carried in a PYTHONPATH folder, a virtual environment)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--notices", type=int, default=2000, help="back-to-back round trips")
    ap.add_argument("--fps", type=float, default=60.0)
    ap.add_argument("--paced", type=int, default=300, help="round trips at --fps")
    ap.add_argument("--spin-us", type=float, default=db.SPIN_S * 1e6, help="both sides spin this long first")
    ap.add_argument("--arrival-spin-us", type=float, default=None,
                    help=f"spin this close to a paced notice's predicted arrival (sets {ENV} for both sides)")
    ap.add_argument("--hold-cpu-awake", action="store_true",
                    help="hold the CPUs' wake-up latency limit at 0 for the run (/dev/cpu_dma_latency)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.notices < 1 or args.paced < 1 or args.fps <= 0 or args.spin_us < 0:
        ap.error("--notices, --paced and --fps must be > 0, --spin-us >= 0")
    db.SPIN_S = args.spin_us / 1e6
    if args.arrival_spin_us is not None:
        os.environ[ENV] = f"{args.arrival_spin_us:g}"  # read by each doorbell as it opens, the child's too
    awake = CpuAwake().hold() if args.hold_cpu_awake else None
    held = bool(awake and awake.held)
    if awake is not None and not held:
        print(f"--hold-cpu-awake: {awake.why}")
    bell = db.Doorbell.create()
    echo = subprocess.Popen([sys.executable, "-c", ECHO, bell.name, str(db.SPIN_S)], cwd=ROOT,
                            stdout=subprocess.PIPE, env=child_env())
    try:
        echo.stdout.readline()
        round_trips(bell, 1, 50, 0.0)  # warm-up
        b2b = round_trips(bell, 100, args.notices, 0.0)
        c0, t0 = process_cpu_s(echo.pid), time.monotonic()
        paced = round_trips(bell, 100 + args.notices, args.paced, 1.0 / args.fps)
        echo_cpu = 100 * (process_cpu_s(echo.pid) - c0) / (time.monotonic() - t0)
        bell.send_frame(0, 0, 1)
        echo.wait(10)
    finally:
        if echo.poll() is None:
            echo.kill()
        bell.close()
        if awake is not None:
            awake.close()
    result = {"cpu_awake": held, "idle": idle_states(),
              "backend": backend(), "spin_us": args.spin_us, "arrival_spin_us": bell.pace.window_s * 1e6,
              "host_spin_turns": bell.spin_turns, "back_to_back": percentiles(b2b),
              "paced": percentiles(paced), "fps": args.fps, "echo_cpu_pct_paced": echo_cpu}
    print(f"CPU idle states (cpu0): {result['idle'] or 'none said by the kernel'}")
    print(f"doorbell round trip ({result['backend']}, spin {args.spin_us:g} us, CPUs held awake: "
          f"{'yes' if result['cpu_awake'] else 'no'}), ms: back to back p50 "
          f"{result['back_to_back']['p50_ms']:.3f} p99 {result['back_to_back']['p99_ms']:.3f}; at {args.fps:g} fps "
          f"p50 {result['paced']['p50_ms']:.3f} p99 {result['paced']['p99_ms']:.3f}; echo process CPU while "
          f"paced {echo_cpu:.1f} % of a core; arrival spin {result['arrival_spin_us']:g} us, "
          f"{bell.spin_turns} turns on this side")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
