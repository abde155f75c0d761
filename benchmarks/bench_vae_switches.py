"""Issue 30's Wan VAE switches one at a time: the decoder's upsampling form, channels-last, the
pixel-side convs' GEMM form.

Random weights, bf16, cudnn benchmark mode, 480x832, one steady streaming chunk. Three tables:
  layers  the decoder's three spatial upsamplers alone, at a steady chunk's shapes, channels-last:
          `nearest` (nearest x2, then the 3x3 conv, as written), `phase` (four 2x2 phase convs as
          one conv, then interleaved), `transposed` (the same taps as one stride-2 transposed conv);
          GPU ms, multiply-adds, TFLOP/s and the largest difference from `nearest`.
  thin    the encoder's first conv (3 -> 96 channels) and the decoder's last (96 -> 3) alone, at a
          steady chunk's shapes, channels-last: cuDNN's conv, then `engine.layers.thin_conv`'s
          rewrite eager and compiled (as the compiled step runs it); GPU ms, largest difference.
  chunk   the full VAE: encode 4 frames -> 1 latent, decode 1 latent -> 4 frames (after a first
          chunk that starts the stream), per variant, a `+`-joined set of switches:
            nearest | phase | transposed   `vae.upsample` (one of them)
            cl        `vae.channels_last` (WanVAE.use_channels_last)
            stack | taps   `vae.thin_convs` (WanVAE.use_thin_convs): either or both
            wide      with stack: the 96-channel (full-resolution) convs stacked too (`vae.thin_convs=wide`)
            compile   `vae.compile_step` (WanVAE.compile_step; tens of seconds per variant)
            tune      with compile: `vae.tune_kernels` (coordinate-descent block sizes; a longer compile)
            graph     a CUDA graph per step, as the session replays them
          median and p90 GPU ms per step, and the largest difference from a plain eager copy
          (nearest, default layout) driven from the same stream state.

GPU:  python benchmarks/bench_vae_switches.py --json out/bench_vae_switches.json
      python benchmarks/bench_vae_switches.py --tables chunk --variants COMPILED \
        --json out/bench_vae_switches_compiled.json
      (COMPILED = the session's path, compile+graph, for each upsample form; the JSON is rewritten
      after every row, so a run cut short keeps what it measured)
CPU:  python benchmarks/bench_vae_switches.py --smoke   (tiny shapes, fp32: checks the script runs)
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
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loom_live.engine.graphs.vae_steps import GraphedStep  # noqa: E402
from loom_live.engine.layers.phase_upsample import UPSAMPLE_KINDS, PhaseUpsampleConv  # noqa: E402
from loom_live.engine.layers.thin_conv import THIN_KINDS, ThinConv3d  # noqa: E402
from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE  # noqa: E402

# (label, frames, channels in, channels out, low-res height, width): a steady chunk at 480x832
LAYERS = (
    ("up_blocks.0 384->192 60x104", 2, 384, 192, 60, 104),
    ("up_blocks.1 384->192 120x208", 4, 384, 192, 120, 208),
    ("up_blocks.2 192->96 240x416", 4, 192, 96, 240, 416),
)
SMOKE_LAYERS = (("smoke 16->8 6x10", 4, 16, 8, 6, 10),)
DEFAULT_VARIANTS = ("nearest+cl+graph", "phase+cl+graph", "transposed+cl+graph", "nearest+graph", "phase+graph")
COMPILED = ("nearest+cl+compile+graph", "phase+cl+compile+graph", "transposed+cl+compile+graph",
            "phase+cl+taps+compile+graph", "phase+cl+stack+taps+compile+graph")
SMOKE_VARIANTS = ("nearest+cl", "phase+cl", "transposed", "phase+cl+stack+taps")  # no graphs on a CPU
SWITCHES = (*UPSAMPLE_KINDS, "cl", *THIN_KINDS, "wide", "compile", "tune", "graph")
# (label, channels in, channels out): the pixel-side convs, T + 2 = 6 frames in at full size
# the full-resolution 96-channel convs (10 a chunk), forced into `stack`: whether a 2D conv over stacked
# frames beats cuDNN's 3D one there (the stacking here is a pass of its own; in the step it could fuse)
THIN_LAYERS = (("encoder.conv_in 3->96", 3, 96, None), ("decoder.conv_out 96->3", 96, 3, None),
               ("full-res 96->96", 96, 96, "stack"))


def time_ms(fn: Callable[[], object], iters: int, warmup: int, cuda: bool) -> list[float]:
    """Per-call times: CUDA events on a GPU (one sync at the end), perf_counter on a CPU."""
    for _ in range(warmup):
        fn()
    marks = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            marks.append((start, end))
        else:
            t0 = time.perf_counter()
            fn()
            marks.append((t0, time.perf_counter()))
    if cuda:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in marks]
    return [(b - a) * 1000.0 for a, b in marks]


def layer_rows(shapes, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows, cuda = [], device.type == "cuda"
    for label, n, cin, cout, h, w in shapes:
        torch.manual_seed(0)
        conv = nn.Conv2d(cin, cout, 3, padding=1).to(device, dtype).to(memory_format=torch.channels_last)
        x = torch.randn(n, cin, h, w, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        forms = {"nearest": lambda t, conv=conv: conv(F.interpolate(t, scale_factor=2.0, mode="nearest-exact"))}
        for kind in UPSAMPLE_KINDS[1:]:
            forms[kind] = PhaseUpsampleConv(conv, kind)
        macs = {"nearest": n * 4 * h * w * 9, "phase": n * (h + 1) * (w + 1) * 16, "transposed": n * h * w * 16}
        with torch.inference_mode():
            ref = forms["nearest"](x).float()
            for kind, fn in forms.items():
                ms = statistics.median(time_ms(lambda fn=fn, x=x: fn(x), args.iters, args.warmup, cuda))
                out = fn(x).float()
                gmac = macs[kind] * cin * cout / 1e9
                rows.append({"table": "layers", "layer": label, "form": kind, "ms": ms, "gmac": gmac,
                             "tflops": 2 * gmac / ms, "rel_diff": ((out - ref).abs().max() / ref.abs().max()).item()})
    return rows


def thin_rows(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    rows, cuda = [], device.type == "cuda"
    for label, cin, cout, kind in THIN_LAYERS:
        torch.manual_seed(0)
        conv = nn.Conv3d(cin, cout, 3, padding=(0, 1, 1)).to(device, dtype)
        conv = conv.to(memory_format=torch.channels_last_3d)
        x = torch.randn(1, cin, 6, args.height, args.width, device=device, dtype=dtype)
        x = x.contiguous(memory_format=torch.channels_last_3d)
        thin = ThinConv3d(conv, kind)
        forms = {"cudnn": conv, f"{thin.kind} eager": thin,
                 f"{thin.kind} compiled": torch.compile(thin, dynamic=False)}
        with torch.inference_mode():
            ref = conv(x).float()
            for form, fn in forms.items():
                ms = statistics.median(time_ms(lambda fn=fn, x=x: fn(x), args.iters, args.warmup, cuda))
                out = fn(x).float()
                rows.append({"table": "thin", "layer": label, "form": form, "ms": ms,
                             "rel_diff": ((out - ref).abs().max() / ref.abs().max()).item()})
    return rows


def parse_variant(text: str) -> tuple[str, set[str]]:
    parts = set(text.split("+"))
    unknown = parts - set(SWITCHES)
    kinds = parts & set(UPSAMPLE_KINDS)
    if "tune" in parts and "compile" not in parts:
        raise SystemExit(f"variant {text!r}: tune needs compile")
    if "wide" in parts and "stack" not in parts:
        raise SystemExit(f"variant {text!r}: wide needs stack")
    if unknown or len(kinds) != 1:
        raise SystemExit(f"variant {text!r}: one of {UPSAMPLE_KINDS} plus any of {SWITCHES[3:]}")
    return kinds.pop(), parts - kinds


def build(preset: str, device: torch.device, dtype: torch.dtype) -> WanVAE:
    torch.manual_seed(0)  # the same weights in every variant and in the reference
    with device:
        vae = WanVAE(VAE_PRESETS[preset])
    return vae.to(dtype=dtype).eval().requires_grad_(False)


def chunk_row(variant: str, args, device: torch.device, dtype: torch.dtype) -> dict:
    kind, switches = parse_variant(variant)
    cuda = device.type == "cuda"
    if "graph" in switches and not cuda:
        return {"error": "skipped: CUDA graphs need a GPU"}
    preset = "tiny" if args.smoke else "wan2.1"
    vae, reference = build(preset, device, dtype), build(preset, device, dtype)
    vae.use_upsample(kind)
    vae.use_thin_convs(tuple(k for k in THIN_KINDS if k in switches), stack_upto=96 if "wide" in switches else 0)
    if "cl" in switches:
        vae.use_channels_last()
    if "compile" in switches:
        vae.compile_step(tune="tune" in switches)
    gen = torch.Generator(device=device).manual_seed(0)
    first = (torch.rand(1, 3, 5, args.height, args.width, generator=gen, device=device) * 2 - 1).to(dtype)
    chunk = first[:, :, 1:].clone()
    state = vae.new_stream_state()
    with torch.inference_mode():
        t0 = time.perf_counter()
        vae.decode_stream(vae.encode_stream(first, state), state)
        latent = vae.encode_stream(chunk, state)
        if cuda:
            torch.cuda.synchronize()
        first_s = time.perf_counter() - t0

        def encode(x):
            return vae.encode_stream(x, state)

        def decode(z):
            return vae.decode_stream(z, state)

        if "graph" in switches:
            encode = GraphedStep(encode, chunk, cache=state.encoder)
            decode = GraphedStep(decode, latent, cache=state.decoder)
        enc = time_ms(lambda: encode(chunk), args.iters, args.warmup, cuda)
        dec = time_ms(lambda: decode(latent), args.iters, args.warmup, cuda)
        snapshot = state.copy()
        z_fast, x_fast = encode(chunk).clone(), decode(latent).clone()
        diff = max((z_fast - reference.encode_stream(chunk, snapshot)).abs().max().item(),
                   (x_fast - reference.decode_stream(latent, snapshot)).abs().max().item())
    e, d = statistics.median(enc), statistics.median(dec)
    return {"encode_ms": e, "decode_ms": d, "total_ms": e + d, "encode_p90_ms": percentile(enc, 90),
            "decode_p90_ms": percentile(dec, 90), "first_chunk_s": first_s, "max_abs_diff_vs_eager": diff}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def write_json(path: Path | None, meta: dict, rows: list[dict]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))


def print_tables(meta: dict, rows: list[dict]) -> None:
    print(f"\nWan VAE switches (issue 30), {meta['height']}x{meta['width']}, {meta['dtype']}, {meta['device']}, "
          f"torch {meta['torch']}, median of {meta['iters']}")
    layers = [r for r in rows if r["table"] == "layers"]
    if layers:
        print(f"\n{'upsampler (steady chunk)':<30} {'form':<11} {'ms':>8} {'GMAC':>7} {'TFLOP/s':>8} {'rel diff':>9}")
        for r in layers:
            print(f"{r['layer']:<30} {r['form']:<11} {r['ms']:>8.3f} {r['gmac']:>7.1f} {r['tflops']:>8.0f} "
                  f"{r['rel_diff']:>9.1e}")
    thin = [r for r in rows if r["table"] == "thin"]
    if thin:
        print(f"\n{'pixel-side conv (steady chunk)':<30} {'form':<17} {'ms':>8} {'rel diff':>9}")
        for r in thin:
            print(f"{r['layer']:<30} {r['form']:<17} {r['ms']:>8.3f} {r['rel_diff']:>9.1e}")
    chunks = [r for r in rows if r["table"] == "chunk"]
    if chunks:
        print(f"\n{'variant':<30} {'enc ms':>8} {'dec ms':>8} {'total':>8} {'enc p90':>8} {'dec p90':>8} "
              f"{'first s':>8} {'max|d|':>8}")
        for r in chunks:
            if "error" in r:
                print(f"{r['variant']:<30} {r['error']}")
                continue
            print(f"{r['variant']:<30} {r['encode_ms']:>8.2f} {r['decode_ms']:>8.2f} {r['total_ms']:>8.2f} "
                  f"{r['encode_p90_ms']:>8.2f} {r['decode_p90_ms']:>8.2f} {r['first_chunk_s']:>8.1f} "
                  f"{r['max_abs_diff_vs_eager']:>8.1e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", default="layers,thin,chunk", help="comma list of layers, thin, chunk")
    parser.add_argument("--variants", default=None,
                        help=f"chunk table: comma list of +-joined switches from {SWITCHES}, or COMPILED")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 16x16, fp32, 2 iterations, no graphs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.height = args.width = 16
        args.iters, args.warmup = 2, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.backends.cudnn.benchmark = True  # as the session runs: fixed shapes, autotuned once
    text = args.variants or ",".join(SMOKE_VARIANTS if args.smoke else DEFAULT_VARIANTS)
    variants = [v for v in text.replace("COMPILED", ",".join(COMPILED)).split(",") if v]
    for v in variants:
        parse_variant(v)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "height": args.height, "width": args.width, "dtype": str(dtype).removeprefix("torch."),
            "iters": args.iters, "warmup": args.warmup, "smoke": args.smoke}
    tables = set(args.tables.split(","))
    rows: list[dict] = []
    if "layers" in tables:
        rows += layer_rows(SMOKE_LAYERS if args.smoke else LAYERS, args, device, dtype)
        write_json(args.json, meta, rows)
    if "thin" in tables:
        rows += thin_rows(args, device, dtype)
        write_json(args.json, meta, rows)
    for variant in variants if "chunk" in tables else ():
        print(f"[bench_vae_switches] {variant} ...", file=sys.stderr, flush=True)
        try:
            result = chunk_row(variant, args, device, dtype)
        except Exception as exc:  # one failing variant must not lose the others' numbers
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        rows.append({"table": "chunk", "variant": variant, **result})
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_json(args.json, meta, rows)
    print_tables(meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
