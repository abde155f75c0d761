"""What FP8 block linears (model.fp8_linear) do to the DiT's flow prediction.

The same stream of latent chunks runs through three copies of one model, each with its own KV
cache, so errors carried through the cache count too: a float32 reference, the bf16 model as
the session runs it, and the bf16 model with its block linears in FP8 (engine/models/fp8_linear.py).
Per chunk it reports ||a - b|| / ||b|| and the cosine similarity of the predicted flow v, for
bf16 vs float32 (the error the session already accepts), FP8 vs float32, and FP8 vs bf16 (what
turning the option on changes). Rows of the stream batch sit at different timesteps, as in
stream-batch denoising.

The flow prediction is the head applied to the residual stream, which is the patch embedding
plus what the blocks add; FP8 touches only the blocks' part. How much of v the blocks make
depends on the weights (random weights: a fraction; trained ones: most of it), so the table also
gives `blocks` = ||v - head(embedding)|| / ||v|| and the FP8 change relative to that part
(`fp8/bf16 of blocks`), the number that carries over best from random to real weights.

Default: Wan2.1 1.3B at 480x832 (latent 60x104), random weights (torch's default init, not
Wan's trained distribution: real weights have outlier channels that per-channel scales absorb
differently, so give --checkpoint for the numbers that matter). On a CPU the FP8 model runs the
exact emulation of torch._scaled_mm.

    python benchmarks/fp8_quality.py --json out/fp8_quality.json      # on a CUDA machine
    python benchmarks/fp8_quality.py --smoke                          # tiny preset, CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom_live.engine.models.fp8_linear import convert_dit_to_fp8  # noqa: E402
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT  # noqa: E402

PAIRS = (("bf16", "fp32"), ("fp8", "fp32"), ("fp8", "bf16"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="wan2.1-1.3b", choices=sorted(DIT_PRESETS))
    p.add_argument("--checkpoint", default=None, help="real DiT weights (default: random, seeded)")
    p.add_argument("--latent", default="60x104", help="latent frame HxW (480x832 pixels -> 60x104)")
    p.add_argument("--timesteps", default="700,500,400,200", help="one stream-batch row per timestep")
    p.add_argument("--chunks", type=int, default=12, help="chunks streamed (the first has 2 latent frames)")
    p.add_argument("--kv", type=int, default=6, help="KV window in latent frames")
    p.add_argument("--sink", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (FP8 emulated)")
    p.add_argument("--json", type=Path, default=None, help="write results here")
    p.add_argument("--smoke", action="store_true", help="tiny preset and shapes: runs on a CPU in seconds")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.latent, args.timesteps, args.chunks = "tiny", "8x8", "700,400", 6
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return args


def build_models(args: argparse.Namespace) -> dict[str, WanDiT]:
    cfg, dev = DIT_PRESETS[args.preset], args.device
    if args.checkpoint:
        ref = WanDiT.from_checkpoint(args.checkpoint, cfg, device=dev, dtype=torch.float32)
    else:
        torch.manual_seed(args.seed)
        with torch.device(dev):
            ref = WanDiT(cfg)
    ref = ref.float().eval().requires_grad_(False)
    bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    fp8 = copy.deepcopy(bf16)
    convert_dit_to_fp8(fp8, emulate=dev.type != "cuda")
    return {"fp32": ref, "bf16": bf16, "fp8": fp8}


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(||a - b|| / ||b||, cosine(a, b)) over everything, in float64."""
    a, b = a.double().flatten(), b.double().flatten()
    return norm_ratio(a - b, b), F.cosine_similarity(a, b, dim=0).item()


def norm_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().norm() / b.double().norm()).item()


def per_row(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Relative error of each stream-batch row (one timestep each)."""
    return [compare(a[i], b[i])[0] for i in range(a.shape[0])]


def run(args: argparse.Namespace) -> dict:
    models = build_models(args)
    cfg, dev = models["fp32"].cfg, args.device
    h, w = (int(v) for v in args.latent.lower().split("x"))
    steps = [float(s) for s in args.timesteps.split(",")]
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    ctx = torch.randn(1, cfg.text_len, cfg.text_dim, generator=gen).to(dev)
    t = torch.tensor(steps, device=dev)
    states = {}
    for name, m in models.items():
        cache = m.new_cache(len(steps), (h, w), num_kv_cache=args.kv, sink=args.sink)
        states[name] = (cache, m.cross_kv(ctx))
    rows, by_step = [], {s: [] for s in steps}
    with torch.inference_mode():
        for i in range(args.chunks):
            frames = 2 if i == 0 else 1
            x = torch.randn(len(steps), cfg.in_channels, frames, h, w, generator=gen).to(dev)
            v = {n: m.forward_stream(x, t, *states[n]).float() for n, m in models.items()}
            tokens, cond, grid = models["fp32"].embed(x, t)
            skip = models["fp32"].head(tokens, cond, grid)  # v with no block at all
            row = {"chunk": i, "frames": frames, "blocks_share": norm_ratio(v["fp32"] - skip, v["fp32"]),
                   "rel_fp8_vs_bf16_of_blocks": norm_ratio(v["fp8"] - v["bf16"], v["bf16"] - skip)}
            for a, b in PAIRS:
                row[f"rel_{a}_vs_{b}"], row[f"cos_{a}_vs_{b}"] = compare(v[a], v[b])
            for s, err in zip(steps, per_row(v["fp8"], v["bf16"])):
                by_step[s].append(err)
            rows.append(row)
    summary = {k: {"mean": statistics.fmean(r[k] for r in rows), "worst": (min if k.startswith("cos") else max)(
        r[k] for r in rows)} for k in rows[0] if k not in ("chunk", "frames")}
    return {"chunks": rows, "summary": summary,
            "rel_fp8_vs_bf16_by_timestep": {str(s): statistics.fmean(e) for s, e in by_step.items()}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32 throughout
    torch.backends.cudnn.allow_tf32 = False
    result = run(args)
    cuda = args.device.type == "cuda"
    env = {
        "device": torch.cuda.get_device_name(args.device) if cuda else f"cpu ({platform.machine()})",
        "fp8_path": "torch._scaled_mm" if cuda else "emulation", "torch": torch.__version__,
        "python": platform.python_version(), "preset": args.preset, "latent": args.latent,
        "weights": args.checkpoint or f"random (seed {args.seed})", "timesteps": args.timesteps,
        "chunks": args.chunks, "kv_window": args.kv, "sink": args.sink, "smoke": args.smoke,
    }
    print(f"\nFP8 block linears vs bf16 vs float32: {args.preset}, latent {args.latent}, timesteps "
          f"{args.timesteps}, {env['weights']} weights, {env['device']}, FP8 via {env['fp8_path']}")
    print("rel = ||a - b|| / ||b|| of the flow prediction; cos = cosine similarity")
    labels = {f"{kind}_{a}_vs_{b}": f"{kind} {a}/{b}" for kind in ("rel", "cos") for a, b in PAIRS}
    labels.update(blocks_share="blocks", rel_fp8_vs_bf16_of_blocks="fp8/bf16 of blk")
    cols = list(labels)
    print(f"{'chunk':>6} " + " ".join(f"{labels[c]:>15}" for c in cols))
    for r in result["chunks"]:
        print(f"{r['chunk']:>6} " + " ".join(f"{r[c]:>15.5f}" for c in cols))
    for stat in ("mean", "worst"):
        print(f"{stat:>6} " + " ".join(f"{result['summary'][c][stat]:>15.5f}" for c in cols))
    by_step = ", ".join(f"t={s}: {e:.5f}" for s, e in result["rel_fp8_vs_bf16_by_timestep"].items())
    print(f"rel fp8/bf16 by timestep row: {by_step}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"env": env, **result}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
