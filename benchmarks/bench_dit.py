"""Time one streaming DiT forward (one latent-frame chunk against a full KV window).

Real shapes, random weights (speed does not depend on weight values). Default: Wan2.1 1.3B at
480x832 (latent 60x104, 1560 tokens per frame), bf16, KV window 6 with 3 sinks, batch 1, 2, 4
(stream-batch rows). Each batch size first streams enough chunks to fill the window, so the
timed forwards are the steady state: eviction, in-place ring writes, unmasked attention.

    python benchmarks/bench_dit.py --json out/bench_dit.json          # on a CUDA machine
    python benchmarks/bench_dit.py --smoke                            # tiny shapes, CPU
    python benchmarks/bench_dit.py --graphs --fuse --fp8              # FP8 block linears (Hopper/Ada)
    python benchmarks/bench_dit.py --graphs --fuse --splits 3 --fuse-qkv   # the window's attention in
                                                  # parts (model.attention_splits), one q/k/v product (model.fuse_qkv)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom_live.engine.graphs.dit_steps import GraphedStreamForward  # noqa: E402
from loom_live.engine.models.fp8_linear import QUANTIZE_KERNELS, convert_dit_to_fp8  # noqa: E402
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT  # noqa: E402
from loom_live.engine.models.wan_dit_ops import BlockOps  # noqa: E402
from loom_live.engine.stream.stage_timer import timed_ms  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="wan2.1-1.3b", choices=sorted(DIT_PRESETS))
    p.add_argument("--latent", default="60x104", help="latent frame HxW (480x832 pixels -> 60x104)")
    p.add_argument("--batches", default="1,2,4", help="comma-separated stream-batch sizes")
    p.add_argument("--kv", type=int, default=6, help="KV window in latent frames")
    p.add_argument("--sink", type=int, default=3)
    p.add_argument("--policy", default="refresh", choices=["refresh", "window"])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--json", type=Path, default=None, help="write results here")
    p.add_argument("--smoke", action="store_true", help="tiny preset and shapes: checks the script on a CPU")
    p.add_argument("--graphs", action="store_true", help="replay the step as CUDA graphs (as the session does)")
    p.add_argument("--fuse", action="store_true",
                   help="compiled norm/modulation/gate/RoPE (WanDiT.fuse_elementwise, as the session does on CUDA)")
    p.add_argument("--fp8", action="store_true",
                   help="FP8 e4m3 block linears (model.fp8_linear; Hopper/Ada). With --smoke on a CPU: the "
                        "emulation, which checks the script, not the speed")
    p.add_argument("--masked-sink-merge", action="store_true",
                   help="with --fuse: the sink merge as a masked Triton write (model.masked_sink_merge)")
    p.add_argument("--fp8-quantize", default="compiled", choices=QUANTIZE_KERNELS,
                   help="with --fp8: the activations' row quantisation (model.fp8_quantize)")
    p.add_argument("--splits", type=int, default=1,
                   help="the self-attention over the window in this many parts (model.attention_splits)")
    p.add_argument("--fuse-qkv", action="store_true", help="q/k/v as one matrix product (model.fuse_qkv)")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.latent, args.batches, args.dtype = "tiny", "8x8", "1,2", "fp32"
        args.warmup, args.iters = 1, 3
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return args


def bench_batch(model: WanDiT, args: argparse.Namespace, batch: int, h: int, w: int) -> dict:
    cfg, dev, dtype = model.cfg, args.device, DTYPES[args.dtype]
    cache = model.new_cache(batch, (h, w), num_kv_cache=args.kv, sink=args.sink, rope_policy=args.policy,
                            device=dev, dtype=dtype)
    cross = model.cross_kv(torch.randn(1, cfg.text_len, cfg.text_dim, device=dev, dtype=dtype))
    chunk = torch.randn(batch, cfg.in_channels, 1, h, w, device=dev, dtype=dtype)
    t = torch.linspace(700, 200, batch, device=dev)
    first = torch.randn(batch, cfg.in_channels, 2, h, w, device=dev, dtype=dtype)
    forward = GraphedStreamForward(model) if args.graphs and dev.type == "cuda" else model.forward_stream
    forward(first, t, cache, cross)  # 2-frame first chunk, as a stream starts
    while min(cache.fill) < args.kv:
        forward(chunk, t, cache, cross)
    step = lambda: forward(chunk, t, cache, cross)  # noqa: E731
    # with graphs: each ring slot's plan runs eagerly once, then is captured
    for _ in range(max(args.warmup, 2 * args.kv) if args.graphs else args.warmup):
        timed_ms(step, dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = sorted(timed_ms(step, dev) for _ in range(args.iters))
    return {
        "batch": batch,
        "cuda_graphs": bool(args.graphs and dev.type == "cuda"),
        "ms_median": statistics.median(times),
        "ms_p10": times[int(0.1 * (len(times) - 1))],
        "ms_p90": times[int(0.9 * (len(times) - 1))],
        "ms_min": times[0],
        "tokens_per_frame": (h // cfg.patch_size[1]) * (w // cfg.patch_size[2]),
        "kv_cache_mib": cache.memory_bytes() / 2**20,
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        "latent_frames_per_s": 1000.0 / statistics.median(times),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    cfg = DIT_PRESETS[args.preset]
    h, w = (int(v) for v in args.latent.lower().split("x"))
    with torch.device(args.device):
        model = WanDiT(cfg)  # random weights, built where it runs
    model = model.to(DTYPES[args.dtype]).eval().requires_grad_(False)
    if args.fuse_qkv:  # after the dtype cast, which would give each third storage of its own
        model.fuse_projections()
    if args.fuse or args.splits > 1:
        ops = BlockOps.compiled(attention_splits=args.splits, masked_sink_merge=args.masked_sink_merge) \
            if args.fuse else BlockOps.eager(attention_splits=args.splits)
        model.fuse_elementwise(ops)
    if args.fp8:  # after the dtype cast and the block ops; refuses a CPU unless --smoke
        convert_dit_to_fp8(model, emulate=args.smoke and args.device.type == "cpu", compiled=args.fuse,
                           kernels=args.fp8_quantize)
    results = []
    with torch.inference_mode():
        for batch in (int(b) for b in args.batches.split(",")):
            results.append(bench_batch(model, args, batch, h, w))
    try:
        import flash_attn  # noqa: F401

        flash = True
    except ImportError:
        flash = False
    cuda = args.device.type == "cuda"
    env = {
        "device": torch.cuda.get_device_name(args.device) if cuda else f"cpu ({platform.machine()})",
        "torch": torch.__version__, "python": platform.python_version(), "flash_attn": flash,
        "preset": args.preset, "latent": [h, w], "dtype": args.dtype, "kv_window": args.kv, "sink": args.sink,
        "rope_policy": args.policy, "fuse_elementwise": args.fuse, "cuda_graphs": args.graphs, "fp8_linear": args.fp8,
        "fp8_quantize": args.fp8_quantize, "masked_sink_merge": args.masked_sink_merge,
        "attention_splits": args.splits, "fuse_qkv": args.fuse_qkv,
        "warmup": args.warmup, "iters": args.iters, "smoke": args.smoke,
    }
    print(f"\nWanDiT streaming forward: {args.preset}, latent {h}x{w}, 1 latent frame/chunk, "
          f"KV window {args.kv} ({args.sink} sinks), {args.dtype}, {env['device']}, "
          f"graphs={args.graphs}, fused={args.fuse}, fp8={args.fp8 and args.fp8_quantize}, splits={args.splits}, "
          f"qkv={args.fuse_qkv}")
    header = (("B", 3), ("median ms", 10), ("p10 ms", 8), ("p90 ms", 8), ("frames/s", 9),
              ("KV MiB", 8), ("peak GiB", 9))
    print(" ".join(f"{name:>{width}}" for name, width in header))
    for r in results:
        peak = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "-"
        print(f"{r['batch']:>3} {r['ms_median']:>10.2f} {r['ms_p10']:>8.2f} {r['ms_p90']:>8.2f} "
              f"{r['latent_frames_per_s']:>9.1f} {r['kv_cache_mib']:>8.1f} {peak:>9}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"env": env, "results": results}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
