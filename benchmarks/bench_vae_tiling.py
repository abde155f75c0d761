"""Tiled Stream-VAE: activation memory and time per steady step, untiled vs tiled (low-VRAM mode).

For each model (Loom's Wan2.1 VAE `wan2.1`, the TAEHV-layout `taehv`) and each tiling
(`untiled`, or `TILE/OVERLAP` in latent cells, one cell = 8 pixels), runs a stream the way the
session does: a first chunk of 5 frames, then steady steps of 4 frames -> 1 latent (encode) and
1 latent -> 4 frames (decode), eager, cudnn benchmark, channels-last (optionally `--graph`:
each steady step captured as a CUDA graph). Random weights: speed and memory do not depend on
the values (so no quality column: random weights say nothing about seams).

Memory columns are the activation peak of one step: max_memory_allocated during the step minus
what was allocated before it (weights, stream state and inputs excluded), on the GPU only.

GPU:   python benchmarks/bench_vae_tiling.py --json tiling.json
       python benchmarks/bench_vae_tiling.py --height 720 --width 1280 --tilings untiled,32/8,16/4
CPU:   python benchmarks/bench_vae_tiling.py --smoke   (tiny Wan preset, 64x64, fp32: checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom_live.engine.graphs.vae_steps import GraphedStep  # noqa: E402
from loom_live.engine.models.loading import to_channels_last  # noqa: E402
from loom_live.engine.models.taehv import TinyVAE  # noqa: E402
from loom_live.engine.models.vae_tiling import LATENT_SCALE, TiledVAE  # noqa: E402
from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHUNK_FRAMES = 4
DEFAULT_TILINGS = "untiled,32/8,16/4"
MIB = 2**20


def parse_tiling(text: str) -> tuple[int, int] | None:
    if text == "untiled":
        return None
    try:
        tile, overlap = (int(v) for v in text.split("/"))
    except ValueError:
        raise SystemExit(f"tiling {text!r}: expected 'untiled' or TILE/OVERLAP in latent cells, e.g. 32/8") from None
    return tile, overlap


def build(model: str, smoke: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    with device:
        vae = WanVAE(VAE_PRESETS["tiny" if smoke else "wan2.1"]) if model == "wan2.1" else TinyVAE()
    vae = vae.to(dtype=dtype).eval().requires_grad_(False)
    if device.type == "cuda":
        to_channels_last(vae)
    return vae


class StepMeter:
    """Runs one step, returns (output, ms, activation peak MiB); CUDA events and allocator stats on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, step: Callable[[torch.Tensor], torch.Tensor],
                 x: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        if not self.cuda:
            t0 = time.perf_counter()
            out = step(x)
            return out, (time.perf_counter() - t0) * 1000.0, float("nan")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step(x)
        end.record()
        torch.cuda.synchronize()
        return out, start.elapsed_time(end), (torch.cuda.max_memory_allocated() - base) / MIB


def run(model: str, tiling: tuple[int, int] | None, args, device: torch.device) -> dict:
    dtype = DTYPES[args.dtype]
    torch.backends.cudnn.benchmark = device.type == "cuda"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    vae = build(model, args.smoke, device, dtype)
    wrapped = vae if tiling is None else TiledVAE(vae, tile_latents=tiling[0], overlap_latents=tiling[1])
    fmt = torch.channels_last_3d if device.type == "cuda" else torch.contiguous_format
    gen = torch.Generator(device=device).manual_seed(0)
    first = torch.rand((1, 3, 1 + CHUNK_FRAMES, args.height, args.width), generator=gen, device=device)
    first = (first * 2 - 1).to(dtype).contiguous(memory_format=fmt)
    chunk = first[:, :, 1:].contiguous(memory_format=fmt)
    state, meter = wrapped.new_stream_state(), StepMeter(device)

    with torch.inference_mode():
        z_first, first_enc_ms, first_enc_mib = meter(lambda x: wrapped.encode_stream(x, state), first)
        _, first_dec_ms, first_dec_mib = meter(lambda z: wrapped.decode_stream(z, state), z_first)
        latent = wrapped.encode_stream(chunk, state)

        def encode(x: torch.Tensor) -> torch.Tensor:
            return wrapped.encode_stream(x, state)

        def decode(z: torch.Tensor) -> torch.Tensor:
            return wrapped.decode_stream(z, state)

        if args.graph:
            if device.type != "cuda":
                raise RuntimeError("--graph needs a GPU")
            encode = GraphedStep(encode, chunk, cache=state.encoder)
            decode = GraphedStep(decode, latent, cache=state.decoder)
        for _ in range(args.warmup):
            decode(encode(chunk))
        enc = [meter(encode, chunk)[1:] for _ in range(args.iters)]  # (ms, MiB); outputs dropped
        dec = [meter(decode, latent)[1:] for _ in range(args.iters)]
    h, w = args.height // LATENT_SCALE, args.width // LATENT_SCALE
    plan = None if tiling is None else state.decoder.plan
    grid = "1x1" if plan is None else f"{len(plan.rows)}x{len(plan.cols)}"
    enc_ms, dec_ms = statistics.median(t for t, _ in enc), statistics.median(t for t, _ in dec)
    return {
        "latent_hw": [h, w], "tiles": grid, "encode_ms": enc_ms, "decode_ms": dec_ms,
        "fps": CHUNK_FRAMES * 1000.0 / (enc_ms + dec_ms),
        "encode_act_mib": max(m for _, m in enc), "decode_act_mib": max(m for _, m in dec),
        "first_encode_act_mib": first_enc_mib, "first_decode_act_mib": first_dec_mib,
        "first_encode_ms": first_enc_ms, "first_decode_ms": first_dec_ms,
        "state_mib": state.nbytes() / MIB,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="wan2.1,taehv", help="comma list of wan2.1, taehv")
    parser.add_argument("--tilings", default=DEFAULT_TILINGS,
                        help="comma list of 'untiled' and TILE/OVERLAP in latent cells (8 px each)")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--graph", action="store_true", help="capture each steady step as a CUDA graph")
    parser.add_argument("--json", type=Path, help="write all results to this JSON file")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny Wan preset, 64x64, fp32, 2 iterations")
    args = parser.parse_args(argv)
    if args.smoke:
        args.height = args.width = 64
        args.dtype, args.iters, args.warmup = "fp32", 2, 1
        if args.tilings == DEFAULT_TILINGS:
            args.tilings = "untiled,4/2"
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in ("wan2.1", "taehv"):
            raise SystemExit(f"unknown model {m!r}; allowed: wan2.1, taehv")
    tilings = [(t, parse_tiling(t)) for t in args.tilings.split(",") if t]
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "height": args.height, "width": args.width, "dtype": args.dtype, "iters": args.iters,
            "graph": args.graph, "smoke": args.smoke}
    rows = []
    for model in models:
        for name, tiling in tilings:
            print(f"[bench_vae_tiling] {model} {name} ...", file=sys.stderr, flush=True)
            try:
                result = run(model, tiling, args, device)
            except Exception as exc:  # one failing row must not lose the others' numbers
                result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            rows.append({"model": model, "tiling": name, **result})
            if args.json is not None:
                clean = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()} for r in rows]
                args.json.write_text(json.dumps({"meta": meta, "results": clean}, indent=2))
    print_table(meta, rows)
    return 0


def print_table(meta: dict, rows: list[dict]) -> None:
    print(f"\nTiled Stream-VAE, steady step (4 frames <-> 1 latent) at {meta['height']}x{meta['width']}, "
          f"{meta['dtype']}, {meta['device']}, torch {meta['torch']}, graph={meta['graph']} "
          f"(median ms of {meta['iters']}; activation peak MiB = step peak minus allocated before)")
    header = (f"{'model':<7} {'tiling':<8} {'tiles':>5} {'enc ms':>7} {'dec ms':>7} {'FPS':>6} {'enc MiB':>8} "
              f"{'dec MiB':>8} {'1st enc MiB':>11} {'1st dec MiB':>11} {'state MiB':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<7} {r['tiling']:<8} {r['error']}")
            continue
        print(f"{r['model']:<7} {r['tiling']:<8} {r['tiles']:>5} {r['encode_ms']:>7.2f} {r['decode_ms']:>7.2f} "
              f"{r['fps']:>6.1f} {r['encode_act_mib']:>8.1f} {r['decode_act_mib']:>8.1f} "
              f"{r['first_encode_act_mib']:>11.1f} {r['first_decode_act_mib']:>11.1f} {r['state_mib']:>9.1f}")


if __name__ == "__main__":
    sys.exit(main())
