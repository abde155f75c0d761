"""`loom bench`: FPS, time to first frame, latency percentiles, jitter and stage times, vs a baseline."""

from __future__ import annotations

import argparse
import datetime
import platform

import numpy as np

from engine.config import LoomConfig, load_config, lora_override
from plugin.media.video_io import generate_clip, open_source


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark the streaming pipeline (random weights unless given)")
    p.add_argument("-c", "--config", default="wan2.1-1.3b", help="preset name or YAML file (default wan2.1-1.3b)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--frames", type=int, default=3000, help="frames to stream after warm-up")
    p.add_argument("--lora", action="append", default=[], dest="loras", metavar="PATH[:SCALE]",
                   help="a style LoRA file and its scale (default 1.0); repeat for several")
    p.add_argument("--warmup", type=int, default=41, help="frames streamed before measuring")
    p.add_argument("--steps", help="denoising steps, e.g. 700,500")
    p.add_argument("--mode", choices=("auto", "batch", "sequential"))
    p.add_argument("--decoder", choices=("wan", "taehv"), help="VAE decoder")
    p.add_argument("--encoder", choices=("wan", "taehv"), help="VAE encoder")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--input-fps", type=float, default=0.0, help="pace the input (0: as fast as possible)")
    p.add_argument("--clip", help="video file to stream (default: a generated clip)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also time diffusers' eager Wan transformer+VAE on the same shapes")
    p.add_argument("--baseline-chunks", type=int, default=20)
    p.add_argument("--bridge", choices=("auto", "shm", "cuda-ipc", "none"), default="auto",
                   help="also time the host bridge's round trip at the output size through a pass-through "
                        "engine process (auto: cuda-ipc on a GPU, else shm)")
    p.add_argument("--bridge-frames", type=int, default=300)
    p.add_argument("--memory-cap-gib", type=float, default=0.0,
                   help="refuse GPU allocations beyond this many GiB for the Loom run (e.g. 24: prove a "
                        "24 GB card suffices; use with --set memory.low_vram=true)")
    p.add_argument("--gpus", type=int, help="split the DiT over this many GPUs (pipeline parallelism; "
                   "sets parallel.gpus; on a CPU device: processes)")
    p.add_argument("--batches", default="8,16",
                   help="edit family (model.family=edit): the batch sizes B to stream at, e.g. 8,16")
    p.add_argument("--json", help="write the results to this JSON file")
    p.set_defaults(func=run)


def clip_frames(cfg: LoomConfig, source: str | None, count: int) -> np.ndarray:
    """`count` frames at the model size: a real clip looped, or a generated one."""
    w, h = cfg.resolution.width, cfg.resolution.height
    if source:
        with open_source(source) as src:
            frames = [f for _, f in zip(range(count), src)]
        import cv2

        frames = [cv2.resize(f, (w, h), interpolation=cv2.INTER_AREA) for f in frames]
    else:
        frames = list(generate_clip(min(count, 120), (w, h), 24, seed=0))
    reps = -(-count // len(frames))
    return np.stack((frames * reps)[:count])


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.tools.bench import run_baseline, run_loom, summary_table, write_json

    # Random weights unless checkpoints are given; the hash text encoder, since prompt encoding is
    # off the per-frame path (a prompt is encoded once, not per chunk).
    args.overrides = [*args.overrides, *lora_override(args.loras)]
    overrides = ["model.random_weights=true", "vae.random_weights=true", "prompt.encoder=hash", *args.overrides]
    for flag, key in ((args.steps and f"[{args.steps}]", "stream.steps"), (args.mode, "stream.mode"),
                      (args.decoder, "vae.decoder"), (args.encoder, "vae.encoder"),
                      (args.width, "resolution.width"), (args.height, "resolution.height"),
                      (args.gpus, "parallel.gpus")):
        if flag:
            overrides.append(f"{key}={flag}")
    cfg = load_config(args.config, overrides)
    frames = clip_frames(cfg, args.clip, args.warmup + args.frames)
    if cfg.model.family == "edit":
        return _run_edit(args, cfg, frames)
    print(f"loom bench: {cfg.model.preset} {cfg.resolution.width}x{cfg.resolution.height} steps {cfg.stream.steps}"
          f" -- streaming {args.frames} frames after {args.warmup} warm-up", flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "preset": cfg.model.preset,
        "resolution": f"{cfg.resolution.width}x{cfg.resolution.height}",
        "steps": list(cfg.stream.steps),
        "gpus": cfg.parallel.gpus,
        "vae": f"{cfg.vae.encoder}/{cfg.vae.decoder}",
        "config": cfg.to_dict(),
    }
    if args.memory_cap_gib > 0:
        if not torch.cuda.is_available():
            raise SystemExit("--memory-cap-gib needs a CUDA GPU")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total))
        result["memory_cap_gib"] = args.memory_cap_gib
    result["loom"] = run_loom(cfg, frames, args.warmup, args.input_fps)
    if args.memory_cap_gib > 0:
        torch.cuda.set_per_process_memory_fraction(1.0)  # the baseline is not what is being capped
    if args.bridge != "none":
        from engine.tools.bridge_probe import probe

        transport = args.bridge if args.bridge != "auto" else ("cuda-ipc" if torch.cuda.is_available() else "shm")
        print(f"loom bench: bridge round trip over {transport} (pass-through engine process)", flush=True)
        try:
            result["bridge"] = probe(transport, cfg.resolution.width, cfg.resolution.height, frames=args.bridge_frames)
        except Exception as exc:  # the pipeline's numbers above must not be lost to a bridge problem
            result["bridge"] = {"transport": transport, "error": f"{type(exc).__name__}: {exc}"}
    if args.baseline:
        print("loom bench: baseline (diffusers, eager, full-sequence window per chunk)", flush=True)
        result["baseline"] = run_baseline(cfg, frames, args.baseline_chunks, cfg.stream.num_kv_cache)
    print(summary_table(result))
    if args.json:
        write_json(result, args.json)
    return 0


def _run_edit(args: argparse.Namespace, cfg: LoomConfig, frames: np.ndarray) -> int:
    """The edit family: a streaming run per batch size and the encoder's amortisation (no Wan baseline)."""
    import torch

    from engine.tools.bench import write_json
    from engine.tools.bench_edit import edit_summary_table, run_edit

    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        raise SystemExit(f"--batches: {args.batches!r} is not a list of batch sizes such as 8,16") from None
    print(f"loom bench: edit family {cfg.edit.unet} {cfg.resolution.width}x{cfg.resolution.height} "
          f"steps {cfg.edit.steps}, B in {batches} -- streaming {args.frames} frames after {args.warmup} warm-up",
          flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "preset": args.config,
        "resolution": f"{cfg.resolution.width}x{cfg.resolution.height}",
        "config": cfg.to_dict(),
        "edit": run_edit(cfg, frames, args.warmup, args.input_fps, batches),
    }
    print(edit_summary_table(result))
    if args.json:
        write_json(result, args.json)
    return 0

