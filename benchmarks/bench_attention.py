"""The attention kernels' alternatives at the streaming shapes (engine/layers/attention.py), two tables.

window: the DiT's self-attention over the KV window in one call against the window in S parts merged by
their log-sum-exps (`model.attention_splits`).

A 1-latent chunk at 480x832 has 1560 queries against a window of 6 latent frames (9360 keys). With the
1.3B's 12 heads the kernel's grid is a few hundred query tiles, about one wave of a large GPU plus a
nearly empty second one; in parts, the grid is S times larger and each tile walks 1/S of the keys.
The parts cost a copy of the queries per part and a merge pass over S partial outputs (compiled, as in
the stream). Each row: the time per call (a run of back-to-back calls between two CUDA events), the
attention's useful TFLOP/s (4 Lq Lk H D per call) and the largest difference from the one-call result.

vae: the Wan VAE's mid-block attention (one head of 384 channels over a latent frame's 6240 positions,
once per latent frame of a chunk) with torch's kernel against two matrix products with float32 scores
(`vae.attention`); the same columns, the difference against the kernel.

GPU:  python benchmarks/bench_attention.py --json attention.json
CPU:  python benchmarks/bench_attention.py --smoke     (tiny shapes; checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F  # noqa: E402

from loom_live.engine.layers.attention import (  # noqa: E402
    attention,
    matmul_attention,
    merge_partials,
    split_attention,
)
from loom_live.engine.stream.stage_timer import timed_ms  # noqa: E402

HEADS = {"wan2.1-1.3b": 12, "wan2.1-14b": 40}
FRAME_TOKENS = 1560  # one latent frame at 480x832
WINDOW = 6  # latent frames in the KV window (stream.num_kv_cache)
VAE_POSITIONS, VAE_DIM = 6240, 384  # one latent frame at 480x832, the mid block's width
VAE_FORMS = {"kernel": lambda q, k, v: F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0],
             "matmul": matmul_attention}


def time_ms(fn: Callable[[], torch.Tensor], runs: int, per_run: int, device: torch.device) -> float:
    """Median over `runs` of the mean ms per call in a run of `per_run` back-to-back calls."""
    for _ in range(3):
        fn()
    times = sorted(timed_ms(lambda: [fn() for _ in range(per_run)], device) / per_run for _ in range(runs))
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latents", default="1,2", help="comma list of latent frames per chunk (queries = latents x 1560)")
    ap.add_argument("--splits", default="1,2,3,6", help="comma list of parts (1 = one call; each must divide 6)")
    ap.add_argument("--models", default=",".join(HEADS), help=f"comma list of {', '.join(HEADS)}")
    ap.add_argument("--vae-frames", default="1,2", help="comma list of latent frames through the VAE's attention")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32, on the CPU")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    tokens, dim = (24, 16) if args.smoke else (FRAME_TOKENS, 128)
    heads = {"smoke": 2} if args.smoke else {m: HEADS[m] for m in args.models.split(",")}
    merge = torch.compile(merge_partials, fullgraph=True) if dev == "cuda" else merge_partials
    rows = []
    with torch.inference_mode():
        for (name, h), latents in ((m, lat) for m in heads.items() for lat in map(int, args.latents.split(","))):
            lq, lk = latents * tokens, WINDOW * tokens
            q = torch.randn(1, lq, h, dim, device=dev, dtype=dtype)
            k = torch.randn(1, lk, h, dim, device=dev, dtype=dtype)
            v = torch.randn(1, lk, h, dim, device=dev, dtype=dtype)
            ref = attention(q, k, v).float()
            for splits in map(int, args.splits.split(",")):
                fn = partial(split_attention, q, k, v, splits=splits, merge=merge)
                ms = time_ms(fn, args.runs, 2 if args.smoke else 20, torch.device(dev))
                rows.append({"table": "window", "model": name, "heads": h, "queries": lq, "keys": lk,
                             "splits": splits, "ms": ms,
                             "tflops": 4 * lq * lk * h * dim / ms / 1e9,
                             "max_abs_diff": (fn().float() - ref).abs().max().item(),
                             "ref_max_abs": ref.abs().max().item()})
        positions, width = (24, 40) if args.smoke else (VAE_POSITIONS, VAE_DIM)
        for frames in map(int, args.vae_frames.split(",")):
            q, k, v = (torch.randn(frames, positions, width, device=dev, dtype=dtype) for _ in range(3))
            ref = VAE_FORMS["kernel"](q, k, v).float()
            for form, fn in VAE_FORMS.items():
                ms = time_ms(partial(fn, q, k, v), args.runs, 2 if args.smoke else 20, torch.device(dev))
                rows.append({"table": "vae", "frames": frames, "positions": positions, "dim": width, "form": form,
                             "ms": ms, "tflops": 4 * frames * positions**2 * width / ms / 1e9,
                             "max_abs_diff": (fn(q, k, v).float() - ref).abs().max().item(),
                             "ref_max_abs": ref.abs().max().item()})
    print(f"self-attention over a {WINDOW}-frame window, {dtype}, {dev}: one call (splits 1) or in parts")
    print(f"{'model':<14}{'queries':>8}{'keys':>7}{'splits':>7}{'ms':>9}{'TFLOP/s':>9}{'max|d|':>10}")
    for r in (r for r in rows if r["table"] == "window"):
        print(f"{r['model']:<14}{r['queries']:>8}{r['keys']:>7}{r['splits']:>7}{r['ms']:>9.3f}{r['tflops']:>9.1f}"
              f"{r['max_abs_diff']:>10.1e}")
    print(f"VAE mid-block attention, one head of {width} channels over {positions} positions per frame")
    print(f"{'frames':>6}{'form':>8}{'ms':>9}{'TFLOP/s':>9}{'max|d|':>10}")
    for r in (r for r in rows if r["table"] == "vae"):
        print(f"{r['frames']:>6}{r['form']:>8}{r['ms']:>9.3f}{r['tflops']:>9.1f}{r['max_abs_diff']:>10.1e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
                       "results": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
