"""The DiT feed-forward's first half, GELU(tanh)(x @ W + b): separate kernels against one matmul with
cuBLASLt's GELU epilogue, at a Wan block's shapes: the DiT's own two ops (engine/models/wan_dit_ops.py,
`linear_gelu` eager, `linear_gelu_epilogue` compiled; on a CPU both are the plain pair).

Unfused, the GELU is its own pass over the [tokens, ffn_dim] activation (read and write in bf16) after
the matmul wrote it; the epilogue applies it before the matmul's only write. Whether that pays depends
on the matmul kernel cuBLASLt picks with the epilogue, so this measures both, with the largest
difference between their outputs (the epilogue rounds once, the unfused path twice).

GPU:  python benchmarks/bench_ffn_gelu.py --json ffn_gelu.json
CPU:  python benchmarks/bench_ffn_gelu.py --smoke     (tiny shapes; checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom_live.engine.models.wan_dit_ops import linear_gelu as unfused  # noqa: E402
from loom_live.engine.models.wan_dit_ops import linear_gelu_epilogue as epilogue  # noqa: E402
from loom_live.engine.stream.stage_timer import timed_ms  # noqa: E402

SHAPES = {"wan2.1-1.3b": (1536, 8960), "wan2.1-14b": (5120, 13824)}


def time_ms(fn: Callable[[], torch.Tensor], iters: int, warmup: int, device: torch.device) -> float:
    """Median ms per call: CUDA events on a GPU, the wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed_ms(fn, device) for _ in range(iters))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1560,6240",
                    help="comma list of row counts: one latent frame at 480x832 is 1560 tokens (a 1-latent chunk, "
                         "the 1-step stream's), four are 6240")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, float32, on the CPU")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = {"smoke": (64, 256)} if args.smoke else SHAPES
    counts = [96] if args.smoke else [int(t) for t in args.tokens.split(",")]
    rows = []
    for (name, (dim, ffn)), tokens in ((s, t) for s in shapes.items() for t in counts):
        x = torch.randn(tokens, dim, device=dev, dtype=dtype)
        w = torch.randn(ffn, dim, device=dev, dtype=dtype) / dim**0.5
        b = torch.randn(ffn, device=dev, dtype=dtype) * 0.1
        ref, got = unfused(x, w, b).float(), epilogue(x, w, b).float()
        rows.append({
            "model": name, "tokens": tokens, "dim": dim, "ffn_dim": ffn,
            "unfused_ms": time_ms(partial(unfused, x, w, b), args.iters, 20, torch.device(dev)),
            "epilogue_ms": time_ms(partial(epilogue, x, w, b), args.iters, 20, torch.device(dev)),
            "max_abs_diff": (got - ref).abs().max().item(), "ref_max_abs": ref.abs().max().item(),
        })
    print(f"FFN first half, GELU(tanh)(x W^T + b), {dtype}, {dev}")
    print(f"{'model':<14}{'tokens':>8}{'unfused ms':>12}{'epilogue ms':>13}{'max|d|':>10}")
    for r in rows:
        print(f"{r['model']:<14}{r['tokens']:>8}{r['unfused_ms']:>12.3f}{r['epilogue_ms']:>13.3f}{r['max_abs_diff']:>10.1e}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
