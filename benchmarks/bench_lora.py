"""Style LoRAs at full speed: the same stream with no LoRA, and with two merged LoRAs whose scale
changes live once a second. Random weights and random rank-R LoRAs on every attention and FFN
linear of the preset's DiT (speed does not depend on weight values). Prints one table and writes
JSON: FPS of both runs, their ratio, the GPU time of a scale change (the session's `lora` stage) and
what a change adds to the stream as the host sees it (the longest push after it, less the median push,
beside the same over as many pushes that carry no change).
`--merge-only`: the merge alone, no stream: host and GPU time of a scale change, eager and replayed
as the captured CUDA graph.

    python benchmarks/bench_lora.py --json out/bench_lora.json                 # 1.3B, 480x832, 1 step
    python benchmarks/bench_lora.py --merge-only --json out/bench_lora_merge.json
    python benchmarks/bench_lora.py --config default --frames 40 --json /tmp/l.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom_live.engine.config import load_config  # noqa: E402
from loom_live.engine.models.dit_convert import to_diffusers_key  # noqa: E402
from loom_live.engine.models.lora import LoraMerger, read_lora  # noqa: E402
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT  # noqa: E402
from loom_live.engine.tools.bench import run_loom  # noqa: E402
from loom_live.plugin.cli.bench import clip_frames  # noqa: E402


def write_random_lora(preset: str, rank: int, seed: int, path: Path) -> None:
    """A diffusers-layout LoRA of this rank on every linear of the preset's DiT blocks."""
    with torch.device("meta"):
        model = WanDiT(DIT_PRESETS[preset])
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.startswith("blocks."):
            base = "transformer." + to_diffusers_key(name + ".weight").removesuffix(".weight")
            sd[f"{base}.lora_A.weight"] = (torch.randn(rank, m.in_features, generator=g) * 0.01).to(torch.bfloat16)
            sd[f"{base}.lora_B.weight"] = (torch.randn(m.out_features, rank, generator=g) * 0.01).to(torch.bfloat16)
    save_file(sd, str(path))


def merge_times(preset: str, paths: list[Path], changes: int) -> dict[str, dict[str, float]]:
    """Median host and GPU ms of one live scale change of the first LoRA, eager and as the captured graph."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(device):
        model = WanDiT(DIT_PRESETS[preset]).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    out = {}
    for label in ("eager", "graph"):
        merger = LoraMerger(model)
        for path in paths:
            merger.add(read_lora(path, model, f"{path.stem}-{label}"), 0.8)
        if label == "graph":
            merger.capture()
        name, host, gpu = f"{paths[0].stem}-{label}", [], []
        for i in range(changes):
            if device.type == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            merger.set_scale(name, 0.4 if i % 2 else 0.8)
            host.append((time.perf_counter() - t0) * 1e3)
            if device.type == "cuda":
                end.record()
                end.synchronize()
                gpu.append(start.elapsed_time(end))
        out[label] = {"host_ms_p50": sorted(host)[len(host) // 2], "gpu_ms_p50": sorted(gpu)[len(gpu) // 2] if gpu
                      else float("nan"), "builds": merger.builds}
        for n in list(merger.scales):  # back to the original weights before the next merger takes them
            merger.set_scale(n, 0.0)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", default="wan2.1-1.3b", help="preset or YAML (default wan2.1-1.3b)")
    p.add_argument("--steps", default="700", help="step list, e.g. 700 or 700,500")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank")
    p.add_argument("--frames", type=int, default=1500, help="frames measured per run")
    p.add_argument("--warmup", type=int, default=41, help="frames streamed before measuring")
    p.add_argument("--period", type=float, default=1.0, help="seconds between live scale changes")
    p.add_argument("--merge-only", action="store_true", help="time the merge alone (no stream)")
    p.add_argument("--changes", type=int, default=50, help="--merge-only: scale changes timed")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for both runs (repeatable), e.g. stream.lora_priority=false")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    base = ["model.random_weights=true", "vae.random_weights=true", "prompt.encoder=hash",
            f"stream.steps=[{args.steps}]", *args.set]
    preset = load_config(args.config, base).model.preset
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"style{i}.safetensors" for i in range(2)]
        for i, path in enumerate(paths):
            write_random_lora(preset, args.rank, i, path)
        if args.merge_only:
            times = merge_times(preset, paths, args.changes)
            for label, t in times.items():
                print(f"scale change, {label}: host {t['host_ms_p50']:.3f} ms, GPU {t['gpu_ms_p50']:.3f} ms (p50)")
            if args.json:
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps({"preset": preset, "rank": args.rank, **times}, indent=2))
            return 0
        loras = "lora=[" + ", ".join(f"{{path: {p}, scale: 0.8}}" for p in paths) + "]"
        for label, overrides, period in (("no LoRA", base, 0.0), ("2 LoRAs, live scale", [*base, loras], args.period)):
            cfg = load_config(args.config, overrides)
            frames = clip_frames(cfg, None, args.warmup + args.frames)
            results[label] = run_loom(cfg, frames, args.warmup, input_fps=0.0, lora_period_s=period)
    plain, lora = results["no LoRA"], results["2 LoRAs, live scale"]
    change_ms = lora["stages_ms"].get("lora", {})
    excess = lora.get("lora_change_excess_ms", {})
    print(f"\n{'run':<22} {'FPS':>8} {'p99 ms':>8} {'scale changes':>14}")
    for label, r in results.items():
        print(f"{label:<22} {r['fps']:>8.2f} {r['latency_ms'].get('p99', float('nan')):>8.1f} {r['lora_changes']:>14}")
    print(f"LoRA / no LoRA: {lora['fps'] / plain['fps']:.3f}; merge span at a chunk (the whole merge, or one of "
          f"stream.lora_merge_parts parts): {change_ms}")
    print(f"a change adds to the pushes that carry it (its parts, or the one after; quiet_*: as many pushes "
          f"with no change): {excess}")
    if args.json:
        out = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
               "config": args.config, "steps": args.steps, "rank": args.rank, "runs": results,
               "fps_ratio": lora["fps"] / plain["fps"], "scale_change_ms": change_ms,
               "change_excess_ms": excess}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
