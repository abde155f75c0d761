"""Stream-VAE speed: encode and decode time per 4-frame chunk, steady-state streaming mode.

Measures Loom's Wan2.1 VAE (`wan2.1`), the TAEHV-layout tiny VAE (`taehv`) and, as a
baseline, diffusers' AutoencoderKLWan driven chunk by chunk through its own feature cache
(`diffusers`, eager only), with random weights (speed does not depend on weight values).

Each variant is a `+`-joined set of switches, so the lead can see what pays:
  eager    plain PyTorch
  cudnn    torch.backends.cudnn.benchmark = True
  cl       channels-last weights and activations (channels_last_3d for 3D convs)
  fuse     WanVAE.fuse_norms(): only the RMS-norm+SiLU steps compiled (Wan VAE only)
  compile  torch.compile of the encoder and decoder (default mode, static shapes)
  compmax  torch.compile with mode="max-autotune-no-cudagraphs"
  graph    CUDA graph over the fixed-shape steady chunk step (engine.cache.vae_cache.GraphedStep)
A steady chunk is 4 pixel frames -> 1 latent (encode) and 1 latent -> 4 frames (decode),
after a first chunk of 5 frames that starts the stream. Timing: CUDA events around every
step, `--warmup` untimed steps first, median and p90 over `--iters` steps.

GPU:   python benchmarks/bench_vae.py --json vae.json
       python benchmarks/bench_vae.py --models wan2.1 --variants eager,cudnn+cl,cudnn+cl+graph
       (each compile variant of the full VAE compiles for a minute or more: split long runs by
       --models / --variants; the JSON is rewritten after every variant, so a run that hits a
       time limit keeps what it measured)
CPU:   python benchmarks/bench_vae.py --smoke        (tiny shapes, float32; checks the script runs)
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
from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE  # noqa: E402

SWITCHES = ("eager", "cudnn", "cl", "fuse", "compile", "compmax", "graph")
DEFAULT_VARIANTS = (
    "eager", "cudnn", "cudnn+cl", "cudnn+cl+graph", "cudnn+cl+fuse", "cudnn+cl+fuse+graph",
    "cudnn+cl+compile", "cudnn+cl+compile+graph",
)
SMOKE_VARIANTS = ("eager", "cudnn+cl", "cudnn+cl+graph")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHUNK_FRAMES = 4


def parse_variant(text: str) -> set[str]:
    parts = set(text.split("+"))
    unknown = parts - set(SWITCHES)
    if unknown:
        raise SystemExit(f"unknown switch(es) {sorted(unknown)} in variant {text!r}; allowed: {SWITCHES}")
    if {"compile", "compmax"} <= parts:
        raise SystemExit(f"variant {text!r}: pick one of compile / compmax")
    return parts - {"eager"}


def build(model: str, smoke: bool, device: torch.device, dtype: torch.dtype):
    with device:
        if model == "wan2.1":
            vae = WanVAE(VAE_PRESETS["tiny" if smoke else "wan2.1"])
        elif model == "taehv":
            vae = TinyVAE()
        else:
            vae = DiffusersStream(smoke)
    return vae.to(dtype=dtype).eval().requires_grad_(False)


class DiffusersStream(torch.nn.Module):
    """diffusers' AutoencoderKLWan stepped chunk by chunk through its own feature-cache lists."""

    def __init__(self, smoke: bool) -> None:
        super().__init__()
        from diffusers import AutoencoderKLWan

        self.ref = AutoencoderKLWan(base_dim=16 if smoke else 96)
        self.ref.clear_cache()
        self.started = {"enc": False, "dec": False}

    def new_stream_state(self) -> None:
        self.ref.clear_cache()
        self.started = {"enc": False, "dec": False}

    def encode_stream(self, x: torch.Tensor, state) -> torch.Tensor:
        ref, out = self.ref, []
        pieces = [x[:, :, :1], x[:, :, 1:]] if not self.started["enc"] else [x]
        for piece in (p for p in pieces if p.shape[2]):
            ref._enc_conv_idx = [0]
            out.append(ref.encoder(piece, feat_cache=ref._enc_feat_map, feat_idx=ref._enc_conv_idx))
        self.started["enc"] = True
        return ref.quant_conv(torch.cat(out, 2))[:, :16]

    def decode_stream(self, z: torch.Tensor, state) -> torch.Tensor:
        ref, out = self.ref, []
        h = ref.post_quant_conv(z)
        for i in range(z.shape[2]):
            ref._conv_idx = [0]
            first = not self.started["dec"]
            out.append(ref.decoder(h[:, :, i:i + 1], feat_cache=ref._feat_map, feat_idx=ref._conv_idx,
                                   first_chunk=first))
            self.started["dec"] = True
        return torch.cat(out, 2).clamp_(-1, 1)


def apply_compile(vae: torch.nn.Module, mode: str | None) -> None:
    """Compile the whole stream step (validation, layers and cache updates; static shapes).

    The first chunk and the steady chunk differ in shape and in `cache.started`, so each
    compiles once; the steady one is what the timed loop runs.
    """
    for name in ("encode_stream", "decode_stream"):
        setattr(vae, name, torch.compile(getattr(vae, name), mode=mode, dynamic=False))


class Clock:
    """CUDA events on a GPU (no host sync inside the loop), perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1000.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def run_variant(model: str, switches: set[str], args, device: torch.device) -> dict:
    dtype = DTYPES[args.dtype]
    torch.backends.cudnn.benchmark = "cudnn" in switches
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    vae = build(model, args.smoke, device, dtype)
    if model == "diffusers" and switches:
        raise RuntimeError("the diffusers baseline runs eager only")
    fmt = torch.contiguous_format
    if "cl" in switches:
        to_channels_last(vae)
        fmt = torch.channels_last_3d
    if "fuse" in switches:
        if not hasattr(vae, "fuse_norms"):
            raise RuntimeError("not applicable: this model has no norms to fuse")
        vae.fuse_norms()
    if switches & {"compile", "compmax"}:
        apply_compile(vae, "max-autotune-no-cudagraphs" if "compmax" in switches else None)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (args.batch, 3, 1 + CHUNK_FRAMES, args.height, args.width)
    first = (torch.rand(shape, generator=gen, device=device) * 2 - 1).to(dtype).contiguous(memory_format=fmt)
    chunk = first[:, :, 1:].contiguous(memory_format=fmt)
    clock = Clock(device)
    state = vae.new_stream_state()

    with torch.inference_mode():
        t0 = time.perf_counter()
        z_first = vae.encode_stream(first, state)
        vae.decode_stream(z_first, state)
        clock.sync()
        first_ms = (time.perf_counter() - t0) * 1000.0
        latent = vae.encode_stream(chunk, state)

        def encode_step(x):
            return vae.encode_stream(x, state)

        def decode_step(z):
            return vae.decode_stream(z, state)

        encode, decode = encode_step, decode_step
        if "graph" in switches:
            if device.type != "cuda":
                raise RuntimeError("CUDA graphs need a GPU")
            encode = GraphedStep(encode_step, chunk, cache=state.encoder)
            decode = GraphedStep(decode_step, latent, cache=state.decoder)
        enc_ms, dec_ms = timed_loop(encode, decode, chunk, latent, clock, args)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        diff = float("nan")
        if state is not None:
            reference = build(model, args.smoke, device, dtype)
            reference.load_state_dict(vae.state_dict())
            diff = diff_from_eager(reference, encode, decode, chunk, latent, state)
    enc, dec = statistics.median(enc_ms), statistics.median(dec_ms)
    return {
        "encode_ms": enc, "decode_ms": dec, "total_ms": enc + dec,
        "encode_p90_ms": percentile(enc_ms, 90), "decode_p90_ms": percentile(dec_ms, 90),
        "fps": CHUNK_FRAMES * 1000.0 / (enc + dec), "first_chunk_ms": first_ms, "peak_mem_gib": peak,
        "state_mib": state.nbytes() / 2**20 if state is not None else float("nan"),
        "max_abs_diff_vs_eager": diff,
    }


def diff_from_eager(reference, encode: Callable, decode: Callable, chunk: torch.Tensor,
                    latent: torch.Tensor, state) -> float:
    """One more step through the measured path, and through a plain eager copy of the model
    (same weights, default layout, nothing fused or compiled) from the same stream state.

    A fast path that computes something else is worthless; this catches it (bf16 differences
    of a few 1e-2 between kernel choices are normal, anything near 1 is not).
    """
    snapshot = state.copy()
    z_fast, x_fast = encode(chunk).clone(), decode(latent).clone()
    z_eager = reference.encode_stream(chunk, snapshot)
    x_eager = reference.decode_stream(latent, snapshot)
    return max((z_fast - z_eager).abs().max().item(), (x_fast - x_eager).abs().max().item())


def timed_loop(encode: Callable, decode: Callable, chunk: torch.Tensor, latent: torch.Tensor,
               clock: Clock, args) -> tuple[list[float], list[float]]:
    for _ in range(args.warmup):
        decode(encode(chunk))
    marks = []
    for _ in range(args.iters):
        a = clock.mark()
        encode(chunk)
        b = clock.mark()
        decode(latent)
        c = clock.mark()
        marks.append((a, b, c))
    clock.sync()
    return [clock.ms(a, b) for a, b, _ in marks], [clock.ms(b, c) for _, b, c in marks]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="wan2.1,taehv,diffusers",
                        help="comma list of wan2.1, taehv, diffusers (diffusers: eager baseline only)")
    parser.add_argument("--variants", default=None,
                        help=f"comma list of +-joined switches from {SWITCHES}")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batch", type=int, default=1,
                        help="streams encoded and decoded together in one call (e.g. 2: a VACE stream's video and "
                             "control encodes batched); times are per call")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write all results to this JSON file")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU, 32x32, fp32, tiny Wan preset, 2 iterations, no compile unless asked "
                             "(torch.compile takes minutes on a CPU): checks that the script runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.height = args.width = 32
        args.dtype, args.iters, args.warmup = "fp32", 2, 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    models = [m for m in args.models.split(",") if m]
    variants = [v for v in (args.variants or ",".join(SMOKE_VARIANTS if args.smoke else DEFAULT_VARIANTS))
                .split(",") if v]
    for m in models:
        if m not in ("wan2.1", "taehv", "diffusers"):
            raise SystemExit(f"unknown model {m!r}; allowed: wan2.1, taehv, diffusers")
    parsed = {v: parse_variant(v) for v in variants}
    meta = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "height": args.height, "width": args.width, "dtype": args.dtype,
        "chunk_frames": CHUNK_FRAMES, "batch": args.batch, "iters": args.iters, "warmup": args.warmup,
        "smoke": args.smoke,
    }

    rows = []
    for model in models:
        for variant in (["eager"] if model == "diffusers" else variants):
            switches = parsed.get(variant, set())
            if device.type != "cuda" and "graph" in switches:
                rows.append({"model": model, "variant": variant, "error": "skipped: needs CUDA"})
                continue
            print(f"[bench_vae] {model} {variant} ...", file=sys.stderr, flush=True)
            try:
                result = run_variant(model, switches, args, device)
            except Exception as exc:  # one failing variant must not lose the others' numbers
                result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
            rows.append({"model": model, "variant": variant, **result})
            print(f"[bench_vae]   {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
            torch._dynamo.reset()
            write_json(args.json, meta, rows)
    print_table(meta, rows)
    return 0


def write_json(path: Path | None, meta: dict, rows: list[dict]) -> None:
    if path is not None:
        clean = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()} for r in rows]
        path.write_text(json.dumps({"meta": meta, "results": clean}, indent=2))  # NaN -> null


def print_table(meta: dict, rows: list[dict]) -> None:
    print(f"\nStream-VAE, steady {meta['chunk_frames']}-frame chunk x {meta['batch']} at "
          f"{meta['height']}x{meta['width']}, {meta['dtype']}, {meta['device']}, torch {meta['torch']} "
          f"(median of {meta['iters']})")
    header = (f"{'model':<10} {'variant':<24} {'enc ms':>8} {'dec ms':>8} {'total':>8} {'enc p90':>8} "
              f"{'dec p90':>8} {'FPS':>7} {'first ms':>9} {'peak GiB':>9} {'state MiB':>9} {'max|d|':>8}")
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<10} {r['variant']:<24} {r['error']}")
            continue
        print(f"{r['model']:<10} {r['variant']:<24} {r['encode_ms']:>8.2f} {r['decode_ms']:>8.2f} "
              f"{r['total_ms']:>8.2f} {r['encode_p90_ms']:>8.2f} {r['decode_p90_ms']:>8.2f} {r['fps']:>7.1f} "
              f"{r['first_chunk_ms']:>9.1f} {r['peak_mem_gib']:>9.2f} {r['state_mib']:>9.1f} "
              f"{r['max_abs_diff_vs_eager']:>8.1e}")


if __name__ == "__main__":
    sys.exit(main())
