"""The streaming pipeline with its DiT split over several GPUs: FPS, latency and per-rank stage times.

Real pipeline (preprocess, Wan VAE encode, DiT with per-rank KV caches, VAE decode, uint8 out),
real shapes, random weights (speed does not depend on weight values). For each step list:
the even block split, then the split balanced from the stage times that run measured (rank 0
also encodes, the last rank also decodes, so an even split is not balanced; when their VAE work
alone is the slowest stage they get no block, e.g. [0, 15, 15, 0]), and optionally the one-GPU
session for comparison. Prints one table; `--json` writes every run's stats.

    python benchmarks/bench_pipeline.py --gpus 2 --json out/bench_pipeline.json      # 2 GPUs
    python benchmarks/bench_pipeline.py --gpus 2 --steps 700 --single --json out/pp_1step.json
    python benchmarks/bench_pipeline.py --smoke --json /tmp/bench_pipeline.json        # CPU, tiny
The same as one command: loom bench --gpus 2 --steps 700,500 --set parallel.split=[20,10]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom_live.engine.config import load_config  # noqa: E402
from loom_live.engine.tools.bench import run_loom  # noqa: E402
from loom_live.plugin.cli.bench import clip_frames  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="pipeline ranks (GPUs)")
    p.add_argument("--config", default="wan2.1-1.3b", help="preset or YAML (default wan2.1-1.3b, 480x832)")
    p.add_argument("--steps", action="append", help="a step list such as 700,500 (repeatable; default 700 and 700,500)")
    p.add_argument("--frames", type=int, default=400, help="frames measured per run")
    p.add_argument("--warmup", type=int, default=41, help="frames streamed before measuring (after the warm-up)")
    p.add_argument("--single", action="store_true", help="also run the one-GPU session on the same shapes")
    p.add_argument("--no-balance", action="store_true", help="only the even (or --set parallel.split) split")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--smoke", action="store_true", help="tiny model and shapes on the CPU (checks the script)")
    p.add_argument("--json", help="write every run's results here")
    return p.parse_args(argv)


def one_run(config: str, overrides: list[str], frames_n: int, warmup: int) -> dict:
    cfg = load_config(config, overrides)
    frames = clip_frames(cfg, None, warmup + frames_n)
    stats = run_loom(cfg, frames, warmup, input_fps=0.0)
    stats["gpus"], stats["split"] = cfg.parallel.gpus, stats.get("split", [])
    print(f"  gpus {cfg.parallel.gpus} steps {list(cfg.stream.steps)} split {stats['split'] or '-'}: "
          f"{stats['fps']:.2f} FPS", flush=True)
    return stats


def row(stats: dict, steps: str) -> list[str]:
    lat = stats["latency_ms"]
    ranks = stats.get("ranks") or [{"rank": 0, "stages_ms": stats["stages_ms"]}]
    busy = []
    for r in ranks:  # stage ms per chunk that rank handles
        per_chunk = sum(v["mean"] * v["count"] for v in r["stages_ms"].values()) / max(stats["frames_out"] / 4, 1)
        busy.append(f"r{r['rank']} {per_chunk:.1f}")
    return [str(stats["gpus"]), steps, str(stats["split"] or "-"), f"{stats['fps']:.2f}",
            f"{lat.get('p50') or 0:.1f}/{lat.get('p99') or 0:.1f}", ", ".join(busy),
            str(stats.get("suggested_split") or "-")]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = ["model.random_weights=true", "vae.random_weights=true", "prompt.encoder=hash", "stream.mode=batch"]
    config, frames_n, warmup = args.config, args.frames, args.warmup
    if args.smoke:
        config, frames_n, warmup = "default", 16, 9
        base += ["resolution.width=64", "resolution.height=64", "model.device=cpu"]
    base += args.overrides
    step_lists = args.steps or ["700", "700,500"]
    runs, table = [], []
    for steps in step_lists:
        over = [*base, f"stream.steps=[{steps}]"]
        if args.single:
            runs.append(one_run(config, over, frames_n, warmup))
            table.append(row(runs[-1], steps))
            save(args, runs)
        runs.append(one_run(config, [*over, f"parallel.gpus={args.gpus}"], frames_n, warmup))
        table.append(row(runs[-1], steps))
        save(args, runs)
        suggested = runs[-1].get("suggested_split")
        if not args.no_balance and suggested and suggested != runs[-1]["split"]:
            split = ",".join(map(str, suggested))
            runs.append(one_run(config, [*over, f"parallel.gpus={args.gpus}", f"parallel.split=[{split}]"],
                                frames_n, warmup))
            table.append(row(runs[-1], steps))
            save(args, runs)
    head = ["gpus", "steps", "split", "FPS", "lat p50/p99 ms", "stage ms per chunk by rank", "suggested split"]
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(head)]
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    save(args, runs)
    return 0


def save(args: argparse.Namespace, runs: list[dict]) -> None:
    """Write every run so far: a run stopped by a time limit keeps the runs before it."""
    if not args.json:
        return
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "gpus": args.gpus, "torch": torch.__version__, "runs": runs}, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
