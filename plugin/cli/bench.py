"""`loom bench`: FPS, time to first frame, latency percentiles, jitter and stage times, vs a baseline."""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

from loom_live.engine.config import CPU_PRESETS, RANDOM_WEIGHTS, LoomConfig, load_config, model_family
from loom_live.engine.host_overrides import lora_override
from loom_live.host_bridge.wire.errors import UserError
from loom_live.host_bridge.wire.params import CHUNK_FRAMES, FIRST_CHUNK_FRAMES
from loom_live.plugin.cli.common import add_config_options, non_negative_float, non_negative_int, positive_int
from loom_live.plugin.cli.preflight import check_weights
from loom_live.plugin.media.generated_clip import generate_clip
from loom_live.plugin.media.sources import open_source

CUDA_FRAMES = 3000
CUDA_WARMUP = 41
# The embedded model on a CPU: a few chunks, so a laptop finishes in well under a minute.
CPU_FRAMES = 40
CPU_WARMUP = 9
# options that set a key only the Wan family reads: the key, and what the edit family reads instead
WAN_OPTIONS = {
    "steps": ("stream.steps", "its steps are edit.steps (--set edit.steps=N, 1 to 4)"),
    "mode": ("stream.mode", "it streams in batches of edit.batch frames (--batches)"),
    "decoder": ("vae.decoder", "its autoencoder, both halves, is edit.vae (--set edit.vae=tiny or taesd)"),
    "encoder": ("vae.encoder", "its autoencoder, both halves, is edit.vae (--set edit.vae=tiny or taesd)"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark the streaming pipeline (random weights unless given)",
                       description="Stream a clip through the pipeline and report FPS, time to first frame, "
                                   "latency percentiles, jitter and stage times. Real-size presets run on random "
                                   "weights (speed does not depend on weight values) unless checkpoints are given.")
    add_config_options(p)
    p.add_argument("--frames", type=positive_int, default=None,
                   help=f"frames to stream after warm-up (default {CUDA_FRAMES} on a GPU, {CPU_FRAMES} on a CPU)")
    p.add_argument("--warmup", type=non_negative_int, default=None,
                   help=f"frames streamed before measuring (default {CUDA_WARMUP} on a GPU, {CPU_WARMUP} on a CPU)")
    p.add_argument("--steps", help="denoising steps, e.g. 700,500 (sets stream.steps)")
    p.add_argument("--mode", choices=("auto", "batch", "sequential"), help="stream mode (sets stream.mode)")
    p.add_argument("--decoder", choices=("wan", "taehv"), help="VAE decoder (sets vae.decoder)")
    p.add_argument("--encoder", choices=("wan", "taehv"), help="VAE encoder (sets vae.encoder)")
    p.add_argument("--width", type=int, help="frame width (sets resolution.width)")
    p.add_argument("--height", type=int, help="frame height (sets resolution.height)")
    p.add_argument("--lora", action="append", default=[], dest="loras", metavar="PATH[:SCALE]",
                   help="a style LoRA file and its scale (default 1.0); repeat for several")
    p.add_argument("--input-fps", type=non_negative_float, default=0.0, help="pace the input (0: as fast as possible)")
    p.add_argument("--clip", help="video file to stream (default: a generated clip)")
    p.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=None,
                   help="also time diffusers' eager Wan transformer+VAE on the same shapes (default: on for the "
                        "Wan presets on a GPU; the embedded model has no diffusers counterpart)")
    p.add_argument("--baseline-chunks", type=positive_int, default=20, help="chunks the baseline times (default 20)")
    p.add_argument("--bridge", choices=("auto", "shm", "cuda-ipc", "none"), default="auto",
                   help="also time the host bridge's round trip at the output size through a pass-through "
                        "engine process (auto: cuda-ipc on a GPU, else shm)")
    p.add_argument("--bridge-frames", type=positive_int, default=300,
                   help="frames of the bridge round trip (default 300)")
    p.add_argument("--memory-cap-gib", type=non_negative_float, default=0.0,
                   help="refuse GPU allocations beyond this many GiB for the Loom run (e.g. 24: prove a "
                        "24 GB card suffices; use with --set memory.low_vram=true)")
    p.add_argument("--gpus", type=int, help="split the DiT over this many GPUs (pipeline parallelism; "
                   "sets parallel.gpus; on a CPU device: processes)")
    p.add_argument("--batches", default="8,16",
                   help="edit family (model.family=edit): the batch sizes B to stream at, e.g. 8,16")
    p.add_argument("--profile-chunks", type=non_negative_int, default=0, metavar="N",
                   help="after the measured frames, profile N more chunks kernel by kernel (GPU time per chunk by "
                        "CUDA stream, kernel family and kernel; a GPU, one GPU only); 0: off")
    p.add_argument("--json", help="write the results to this JSON file")
    p.set_defaults(func=run)


def check_json_target(path: str | None) -> None:
    """Refuse a --json the results could not be written to (a folder, a path through a file, a folder that
    cannot be made or written in) before the run, not after it: the folders are made and a file is created
    there and removed again, so nothing is left behind, and the run's end makes them as it writes."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise UserError(f"--json {path}: is a folder; give a file in it, such as {target / 'bench.json'}")
    folder = next(p for p in target.parents if p.exists())
    if not folder.is_dir():
        raise UserError(f"--json {path}: {folder} is a file, not a folder")
    made = [p for p in target.parents if not p.exists()]
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=target.parent).close()
    except OSError as exc:
        raise UserError(f"--json {path}: cannot write in {target.parent} "
                        f"({exc.strerror or type(exc).__name__})") from None
    finally:
        for made_folder in made:  # deepest first; a folder that could not be made is not there to remove
            if made_folder.exists():
                made_folder.rmdir()


def plan(cfg: LoomConfig, frames: int | None, baseline: bool | None, cuda: bool) -> tuple[int, bool]:
    """Frames to stream and whether to run the baseline; a run that cannot finish or compare is refused, with why."""
    if frames is not None and frames < FIRST_CHUNK_FRAMES:
        raise UserError(f"--frames {frames}: a run measures whole chunks; give at least {FIRST_CHUNK_FRAMES}")
    embedded = cfg.model.preset in CPU_PRESETS
    if not cuda and not embedded and frames is None:
        raise UserError(f"preset {cfg.model.preset!r} at {cfg.resolution.width}x{cfg.resolution.height} on a CPU "
                        "takes minutes per frame, so the default run would not finish; bench it on a GPU, use "
                        "-c default (the embedded model), or give --frames N to run it anyway")
    if baseline and embedded:
        raise UserError("--baseline compares against diffusers' Wan2.1 at a real size; the embedded model (-c default) "
                        "has no such counterpart: use -c wan2.1-1.3b, or leave out --baseline")
    if baseline and not cuda:
        raise UserError("--baseline times diffusers' Wan2.1 on a GPU; on a CPU it would not finish")
    return frames or (CUDA_FRAMES if cuda else CPU_FRAMES), (not embedded and cuda) if baseline is None else baseline


def refuse_wan_options(args: argparse.Namespace, overrides: list[str]) -> None:
    """A Wan-only option on the edit family is refused by its own name (`--encoder taehv` on edit-tiny set
    vae.encoder, which the edit family does not read, and benched edit.vae without a word; the config refuses
    such a key only when its value differs from the default, and names the key, not the option)."""
    given = [name for name in WAN_OPTIONS if getattr(args, name) is not None]
    if given and model_family(args.config, overrides) == "edit":
        key, instead = WAN_OPTIONS[given[0]]
        raise UserError(f"--{given[0]} {getattr(args, given[0])}: the edit family does not read it (it sets {key}); "
                        f"{instead}")


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

    from loom_live.engine.tools.bench import run_baseline, run_loom, summary_table, write_json

    check_json_target(args.json)  # a result that cannot be written is said now, not after the whole run
    # Random weights unless checkpoints are given (they come after, in args.overrides)
    args.overrides = [*args.overrides, *lora_override(args.loras)]
    overrides = [*RANDOM_WEIGHTS, *args.overrides]
    refuse_wan_options(args, overrides)
    for flag, key in ((None if args.steps is None else f"[{args.steps}]", "stream.steps"), (args.mode, "stream.mode"),
                      (args.decoder, "vae.decoder"), (args.encoder, "vae.encoder"),
                      (args.width, "resolution.width"), (args.height, "resolution.height"),
                      (args.gpus, "parallel.gpus")):
        if flag is not None:  # 0 too: the config says what is allowed (`--gpus 0` ran one GPU without a word)
            overrides.append(f"{key}={flag}")
    cfg = load_config(args.config, overrides)
    cuda = torch.cuda.is_available()
    if args.bridge == "cuda-ipc" and not cuda:  # said only under the table, after the whole run
        raise UserError("--bridge cuda-ipc: no CUDA device here; use --bridge shm (or auto, shm on a CPU)")
    count, baseline = plan(cfg, args.frames, args.baseline, cuda)
    if args.profile_chunks and (not cuda or cfg.parallel.gpus > 1 or cfg.model.family == "edit"):
        raise UserError(f"--profile-chunks {args.profile_chunks}: a kernel profile needs a CUDA GPU, one GPU and a "
                        "Wan or embedded preset; give 0 (off) or a positive count there")
    # the files given (checkpoints, LoRAs, prompt embeddings) checked as `loom play` checks them, before any model
    # loads; what random weights replace is not asked for (see `missing_weights`)
    check_weights(cfg)
    warmup = args.warmup if args.warmup is not None else (CUDA_WARMUP if cuda else CPU_WARMUP)
    if cfg.model.family == "edit":
        return _run_edit(args, cfg, warmup, count)
    warmup, count = chunk_span(cfg, warmup, count)
    # a generated clip is made once the session is up (run_loom), outside the engine's start-up; a clip file is
    # read now, so a file that cannot be read fails before any engine starts
    frames = functools.cache(functools.partial(clip_frames, cfg, args.clip, warmup + count))
    if args.clip:
        frames()
    print(f"loom bench: {cfg.model.preset} {cfg.resolution.width}x{cfg.resolution.height} steps {cfg.stream.steps}"
          f" -- streaming {count} frames after {warmup} warm-up", file=sys.stderr, flush=True)
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
            raise UserError("--memory-cap-gib needs a CUDA GPU")
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * 2**30 / total))
        result["memory_cap_gib"] = args.memory_cap_gib
    result["loom"] = run_loom(cfg, frames, warmup, args.input_fps, profile_chunks=args.profile_chunks)
    if args.memory_cap_gib > 0:
        torch.cuda.set_per_process_memory_fraction(1.0)  # the baseline is not what is being capped
    if args.bridge != "none":
        from loom_live.engine.tools.bridge_probe import probe

        transport = args.bridge if args.bridge != "auto" else ("cuda-ipc" if torch.cuda.is_available() else "shm")
        print(f"loom bench: bridge round trip over {transport} (pass-through engine process)", file=sys.stderr,
              flush=True)
        try:
            result["bridge"] = probe(transport, cfg.resolution.width, cfg.resolution.height, frames=args.bridge_frames)
        except Exception as exc:  # the pipeline's numbers above must not be lost to a bridge problem
            result["bridge"] = {"transport": transport, "error": f"{type(exc).__name__}: {exc}"}
    if baseline:
        print("loom bench: baseline (diffusers, eager, full-sequence window per chunk)", file=sys.stderr, flush=True)
        result["baseline"] = run_baseline(cfg, frames(), args.baseline_chunks, cfg.stream.num_kv_cache)
    print(summary_table(result))
    if "profile" in result["loom"]:
        from loom_live.engine.tools.chunk_profile import profile_table

        print(profile_table(result["loom"]["profile"]))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {Path(args.json).expanduser()}")
    return 0


def chunk_span(cfg: LoomConfig, warmup: int, count: int) -> tuple[int, int]:
    """The Wan family's warm-up and measured frames in whole chunks (`whole_span`), each rounding said."""
    from loom_live.engine.tools.bench import whole_span

    whole = whole_span(cfg, warmup, count)
    if whole[0] != warmup:
        print(f"loom bench: --warmup {warmup} rounded up to {whole[0]} frames (the first chunk of "
              f"{FIRST_CHUNK_FRAMES}, then whole chunks of {CHUNK_FRAMES}), so the measured frames stay as asked",
              file=sys.stderr)
    if whole[1] != count:
        print(f"loom bench: --frames {count} rounded up to {whole[1]} (whole chunks of {CHUNK_FRAMES}), so the "
              "timed span runs every frame it counts", file=sys.stderr)
    return whole


def _run_edit(args: argparse.Namespace, cfg: LoomConfig, warmup: int, count: int) -> int:
    """The edit family: a streaming run per batch size and the encoder's amortisation (no Wan baseline)."""
    import torch

    from loom_live.engine.tools.bench import write_json
    from loom_live.engine.tools.bench_edit import edit_spans, edit_summary_table, run_edit

    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise UserError(f"--batches: {args.batches!r} is not allowed; expected a list of batch sizes of 1 or more, "
                        "such as 8,16")
    spans = edit_spans(cfg, warmup, count, batches)
    frames = clip_frames(cfg, args.clip, max(w + n for w, n in spans.values()))
    print(f"loom bench: edit family {cfg.edit.unet} {cfg.resolution.width}x{cfg.resolution.height} "
          f"steps {cfg.edit.steps} -- {count} frames after {warmup} warm-up asked, streamed in whole batches: "
          + ", ".join(f"B={b} {n} frames after {w}" for b, (w, n) in spans.items()), file=sys.stderr, flush=True)
    result = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "preset": args.config,
        "resolution": f"{cfg.resolution.width}x{cfg.resolution.height}",
        "config": cfg.to_dict(),
        "edit": run_edit(cfg, frames, spans, args.input_fps),
    }
    print(edit_summary_table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {Path(args.json).expanduser()}")
    return 0

