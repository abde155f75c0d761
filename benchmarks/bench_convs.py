"""The Wan VAE's 3x3x3 causal convolutions alone: what cuDNN reaches, and what other forms would.

At 480x832 the VAE is ~70% of a chunk and its time is mostly these convolutions. For each
distinct conv shape of a steady 4-frame chunk (encoder and decoder), this times, bf16,
channels-last, cudnn benchmark mode:
  conv3d       the layer as the VAE runs it (input = 2 history frames + the chunk's frames)
  conv3d-all   the same with cudnn.benchmark_limit = 0 (cuDNN tries every algorithm)
  conv2d-taps  the same result as one conv2d over the 3 time taps stacked on channels
               (plus, separately, the cost of building that stacked input)
  fp16         conv3d and conv2d-taps in float16, every algorithm tried: the tensor cores' rate
               is the same, but cuDNN's whole list holds other kernels for half (column tiles
               96 wide among them), and float16 keeps more mantissa than bfloat16 where the
               values fit
and prints achieved TFLOP/s, so the gap to the card's peak is visible per shape.

    python benchmarks/bench_convs.py --json out/bench_convs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom_live.engine.stream.stage_timer import median_cuda_ms  # noqa: E402

# (label, channels in, channels out, frames out, height, width): steady chunk at 480x832
SHAPES = (
    ("dec full-res 96", 96, 96, 4, 480, 832),
    ("dec half-res 192", 192, 192, 4, 240, 416),
    ("dec quarter-res 384", 384, 384, 2, 120, 208),
    ("enc full-res 96", 96, 96, 4, 480, 832),
    ("enc half-res 192", 192, 192, 4, 240, 416),
    ("enc quarter-res 384", 384, 384, 2, 120, 208),
)


def bench_shape(cin: int, cout: int, t: int, h: int, w: int, iters: int) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    cl3, cl2 = torch.channels_last_3d, torch.channels_last
    x = torch.randn(1, cin, t + 2, h, w, device=dev, dtype=dt).contiguous(memory_format=cl3)
    wt = (torch.randn(cout, cin, 3, 3, 3, device=dev, dtype=dt) * 0.02).contiguous(memory_format=cl3)
    torch.backends.cudnn.benchmark_limit = 10
    ref = F.conv3d(x, wt, padding=(0, 1, 1))
    ms3 = median_cuda_ms(lambda: F.conv3d(x, wt, padding=(0, 1, 1)), iters)
    torch.backends.cudnn.benchmark_limit = 0
    ms3all = median_cuda_ms(lambda: F.conv3d(x, wt, padding=(0, 1, 1)), iters)
    torch.backends.cudnn.benchmark_limit = 10
    # conv2d over stacked taps: output frame i sees frames i, i+1, i+2 on its channels (tap-major)
    w2 = wt.permute(0, 2, 1, 3, 4).reshape(cout, 3 * cin, 3, 3).contiguous(memory_format=cl2)

    def stack() -> torch.Tensor:
        taps = torch.cat([x[:, :, i:i + t] for i in range(3)], dim=1)  # [1, 3C, t, h, w]
        return taps.transpose(1, 2).reshape(t, 3 * cin, h, w).contiguous(memory_format=cl2)

    xs = stack()
    err = (F.conv2d(xs, w2, padding=1).float() - ref[0].transpose(0, 1).float()).abs().max().item()
    ms2 = median_cuda_ms(lambda: F.conv2d(xs, w2, padding=1), iters)
    x16, wt16, xs16, w216 = (v.half() for v in (x, wt, xs, w2))
    torch.backends.cudnn.benchmark_limit = 0
    ms3h = median_cuda_ms(lambda: F.conv3d(x16, wt16, padding=(0, 1, 1)), iters)
    ms2h = median_cuda_ms(lambda: F.conv2d(xs16, w216, padding=1), iters)
    torch.backends.cudnn.benchmark_limit = 10
    return {"cin": cin, "cout": cout, "frames": t, "h": h, "w": w, "gflop": 2 * cin * cout * 27 * t * h * w / 1e9,
            "conv3d_ms": ms3, "conv3d_all_ms": ms3all, "conv2d_taps_ms": ms2, "stack_ms": median_cuda_ms(stack, iters),
            "conv2d_max_abs_diff": err, "conv3d_fp16_all_ms": ms3h, "conv2d_taps_fp16_all_ms": ms2h}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    rows, seen = [], set()
    with torch.inference_mode():
        for label, *shape in SHAPES:
            if tuple(shape) not in seen:
                seen.add(tuple(shape))
                rows.append({"shape": label, **bench_shape(*shape, iters=args.iters)})
    print(f"\nWan VAE 3x3x3 convs, bf16 channels-last, {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    print(f"{'shape':<22} {'GFLOP':>7} {'conv3d ms':>10} {'TF/s':>6} {'all-algos ms':>13} {'conv2d-taps ms':>15} "
          f"{'TF/s':>6} {'stack ms':>9} {'diff':>8} {'fp16 3d ms':>11} {'fp16 2d ms':>11}")
    for r in rows:
        print(f"{r['shape']:<22} {r['gflop']:>7.0f} {r['conv3d_ms']:>10.3f} {r['gflop'] / r['conv3d_ms']:>6.0f} "
              f"{r['conv3d_all_ms']:>13.3f} {r['conv2d_taps_ms']:>15.3f} {r['gflop'] / r['conv2d_taps_ms']:>6.0f} "
              f"{r['stack_ms']:>9.3f} {r['conv2d_max_abs_diff']:>8.4f} {r['conv3d_fp16_all_ms']:>11.3f} "
              f"{r['conv2d_taps_fp16_all_ms']:>11.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
