"""`loom bench`: the real streaming pipeline on a preset's exact shapes, and a naive baseline.

Loom's number is the StreamSession itself (preprocess, VAE encode, DiT with KV cache, VAE
decode, postprocess to uint8 on the host) fed with frames of a real or generated clip. The
baseline runs the same model shapes the way a user would without Loom: diffusers' Wan
transformer and VAE, eager, one full-sequence forward over a sliding window of latent frames per
chunk (no KV cache, no stream-batch), measured in the same run so the ratio is fair.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loom_live.engine.config import LoomConfig
from loom_live.engine.session_api import open_session
from loom_live.engine.startup_progress import STARTUP_PROGRESS
from loom_live.engine.tools.progress import FrameProgress
from loom_live.host_bridge.wire.files import write_replacing
from loom_live.host_bridge.wire.params import CHUNK_FRAMES, FIRST_CHUNK_FRAMES

FRAMES_PER_CHUNK = CHUNK_FRAMES  # the Wan family's chunk, and each push of the measured span in any family
FIRST_PUSH = FIRST_CHUNK_FRAMES  # the Wan family's first chunk, always warm-up


def units(cfg: LoomConfig) -> tuple[int, int]:
    """The frames of the stream's first unit of work and of each one after: the Wan family's first chunk and
    chunks, the edit family's batches. Frames short of a unit wait in the session for the next push."""
    return (cfg.edit.batch,) * 2 if cfg.model.family == "edit" else (FIRST_PUSH, FRAMES_PER_CHUNK)


def whole_span(cfg: LoomConfig, warmup: int, frames: int) -> tuple[int, int]:
    """The warm-up and measured frames run_loom streams for those asked: whole units, each at least one. A warm-up
    that ends inside a unit leaves its frames held, to be run inside the timed window (an edit run at B=16 after
    the Wan family's 9 warm-up frames ran 48 frames there and counted 40); a measured span that ends inside one
    counts frames never run (`--frames 10` on the Wan family ran 8)."""
    first, unit = units(cfg)
    return first + _whole(warmup - first, unit), max(_whole(frames, unit), unit)


def _whole(frames: int, unit: int) -> int:
    return unit * -(-max(frames, 0) // unit)


def run_loom(cfg: LoomConfig, frames: np.ndarray | Callable[[], np.ndarray], warmup: int, input_fps: float,
             lora_period_s: float = 0.0, profile_chunks: int = 0) -> dict[str, Any]:
    """Stream the frames through a StreamSession (or, with parallel.gpus > 1, the DiT pipeline over
    that many GPUs); metrics over the frames after warm-up, each of the two whole units of work (`whole_span`),
    so the timed window runs exactly the frames it counts. `frames` may be a function that makes them,
    called once the session is ready, so making a clip does not count in the start-up line's time before
    its first phase (what an engine process pays). With `lora_period_s`, the first LoRA's scale
    alternates between its configured value and half of it at that period (live changes).
    With `profile_chunks`, that many more chunks stream under the kernel profiler after the measured
    frames (engine/tools/chunk_profile.py), outside the figures above; its summary is `profile`."""
    if not callable(frames):  # a span run_loom would refuse, refused before the model loads
        _check_span(cfg, warmup, len(frames))
    t_load = time.perf_counter()
    with STARTUP_PROGRESS.to(_progress):  # each start-up phase as it begins (a first GPU start compiles at length)
        session = open_session(cfg)
    _progress(f"session ready (load, compile, warm-up) in {time.perf_counter() - t_load:.1f} s")
    if callable(frames):
        frames = frames()
        try:
            _check_span(cfg, warmup, len(frames))
        except ValueError:
            session.close()
            raise
    device = session.device
    first_push, unit = units(cfg)
    t_start = time.perf_counter()
    first = session.push(frames[:first_push])
    if not len(first):
        first = session.poll(wait=True)
    ttff = time.perf_counter() - t_start if len(first) else None
    done = first_push
    while done < warmup:
        session.push(frames[done:done + unit])
        done += unit
    session.poll(wait=True)
    _sync(device)
    if cfg.parallel.gpus > 1:
        ttff = session.metrics.ttff_s  # a pipeline's first frame leaves after n*P chunks, not on the first push
        session.stats(reset=True)  # every rank's stage times too
    else:
        session.metrics.restart()  # the chunks a stream-batch pipeline still holds keep their push times
    load_peak = 0
    if device.type == "cuda":
        load_peak = torch.cuda.max_memory_reserved(device)  # load, compile and warm-up included
        torch.cuda.reset_peak_memory_stats(device)
    _progress(f"warm-up done ({warmup} frames); measuring {len(frames) - done} frames")
    t0 = time.perf_counter()
    bar = FrameProgress(len(frames) - done, "loom bench")
    changes, next_change = 0, t0 + lora_period_s
    push_s, changed_at = [], []  # each push's wall time; the pushes that carried a LoRA scale change
    for i in range(done, len(frames), FRAMES_PER_CHUNK):
        if lora_period_s and cfg.lora and time.perf_counter() >= next_change:
            changes += 1
            changed_at.append(len(push_s))
            entry = cfg.lora[0]
            session.set_params(lora_scales={entry.key: entry.scale * (0.5 if changes % 2 else 1.0)})
            next_change += lora_period_s
        due = push_due(t0, min(i + FRAMES_PER_CHUNK, len(frames)) - done, input_fps)
        while time.perf_counter() < due:
            time.sleep(min(0.0005, due - time.perf_counter()))
        t_push = time.perf_counter()
        session.push(frames[i:i + FRAMES_PER_CHUNK])
        push_s.append(time.perf_counter() - t_push)
        bar.update(len(frames[i:i + FRAMES_PER_CHUNK]))
    bar.close()
    session.poll(wait=True)
    _sync(device)
    elapsed = time.perf_counter() - t0
    stats = session.stats()
    stats["ttff_s"] = ttff
    stats["lora_changes"] = changes
    if changed_at:
        # a change spread over the merge's parts lengthens any of the pushes that carry a part
        stats["lora_change_excess_ms"] = change_excess_ms(push_s, changed_at,
                                                          after=cfg.stream.lora_merge_parts + 1)
    stats["warmup_frames"], stats["measured_frames"] = warmup, stats["frames_in"]
    stats["fps"] = stream_fps(stats["frames_in"], elapsed)
    if device.type == "cuda":  # what the card must hold, from load to the last frame
        stats["gpu_memory_reserved_peak_bytes"] = max(load_peak, torch.cuda.max_memory_reserved(device))
    if profile_chunks:
        from loom_live.engine.tools.chunk_profile import profile_chunks as profile

        _progress(f"profiling {profile_chunks} more chunks")
        starts = range(done, len(frames) - FRAMES_PER_CHUNK + 1, FRAMES_PER_CHUNK)
        stats["profile"] = profile(
            lambda i: session.push(frames[starts[i % len(starts)]:][:FRAMES_PER_CHUNK]), profile_chunks,
            lambda: (session.poll(wait=True), _sync(device)))
    session.close()
    return stats


def _check_span(cfg: LoomConfig, warmup: int, frames: int) -> None:
    """ValueError unless the warm-up and the measured frames after it are whole units of work (`whole_span`)."""
    span = (warmup, frames - warmup)
    if span != whole_span(cfg, *span):
        raise ValueError(f"warm-up and measured frames {span}: not whole units of work (the first and each "
                         f"after: {units(cfg)} frames); whole_span gives {whole_span(cfg, *span)}")


def push_due(t0: float, frames_through: int, input_fps: float) -> float:
    """When a push may go whose last frame is the `frames_through`-th of the measured span, for an input paced at
    `input_fps` from `t0`: once that frame has come, frame n coming n periods after t0 (so N frames span N
    periods); at once for an input as fast as possible (0)."""
    return t0 + frames_through / input_fps if input_fps > 0 else t0


def stream_fps(frames_pushed: int, elapsed: float) -> float:
    """The measured rate: the frames the timed span pushed, over its time. Not the frames that came out in it:
    those move with what the pipeline holds, a chunk from the warm-up at the start and, after a plan switch
    that drains it (stream-batch to sequential), none at the end, so the span counted a chunk more than it
    took in and a stream that kept up with a paced input read faster than that input."""
    return frames_pushed / elapsed if elapsed > 0 else 0.0


def change_excess_ms(push_s: list[float], changed_at: list[int], after: int = 2) -> dict[str, float]:
    """What a live change adds to the stream, as the host sees it: for each change, the longest of the
    `after` pushes from the one that carried it, less the median push (ms; mean and max over changes).
    A push blocks while the chunks before it finish, so a merge the next forward waits on lengthens one
    of them. The longest of several pushes exceeds the median even with no change, by the stream's own
    jitter, so the same figure over windows that carry none (`quiet_*`: as long, midway between two
    changes, where the gap leaves room) says how much of it the change made."""
    median = float(np.median(push_s))
    excess = [max(push_s[j:j + after]) - median for j in changed_at if j < len(push_s)]
    bounds = [*changed_at, len(push_s)]
    quiet = [max(push_s[m:m + after]) - median
             for j, nxt in zip(bounds, bounds[1:])
             if nxt - j >= 2 * after and (m := j + after + (nxt - j - 2 * after) // 2) + after <= nxt]
    out = {"mean": 1e3 * float(np.mean(excess)), "max": 1e3 * max(excess), "median_push": 1e3 * median,
           "count": len(excess)}
    if quiet:
        out.update(quiet_mean=1e3 * float(np.mean(quiet)), quiet_max=1e3 * max(quiet), quiet_count=len(quiet))
    return out


def _progress(text: str) -> None:
    """Milestones on stderr, so a run stopped by a time limit shows how far it got."""
    print(f"loom bench: {text}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_baseline(cfg: LoomConfig, frames: np.ndarray, chunks: int, window: int) -> dict[str, Any]:
    """diffusers Wan transformer + VAE, eager, a full-sequence forward over a window per chunk."""
    try:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from diffusers.utils import logging as diffusers_logging
    except ImportError as exc:
        raise RuntimeError("the baseline needs diffusers: pip install 'loom-live[bench]'") from exc
    diffusers_logging.set_verbosity_error()  # its notices about unused config keys are not the bench's output
    from loom_live.engine.models.loading import resolve_device, resolve_dtype
    from loom_live.engine.models.wan_dit import DIT_PRESETS

    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    d = DIT_PRESETS[cfg.model.preset]
    with torch.device(device):
        dit = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=d.num_heads, attention_head_dim=d.dim // d.num_heads,
            in_channels=d.in_channels, out_channels=d.out_channels, text_dim=d.text_dim, freq_dim=d.freq_dim,
            ffn_dim=d.ffn_dim, num_layers=d.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            eps=d.eps).to(dtype).eval()
        vae = AutoencoderKLWan().to(dtype).eval() if cfg.vae.preset == "wan2.1" else None
    steps = len(cfg.stream.steps)
    h, w = cfg.resolution.height // 8, cfg.resolution.width // 8
    context = torch.randn(1, 512, d.text_dim, device=device, dtype=dtype)
    latents = torch.randn(1, d.in_channels, window, h, w, device=device, dtype=dtype)
    x = torch.from_numpy(frames[:5]).to(device).permute(3, 0, 1, 2)[None].to(dtype) / 127.5 - 1
    times = []
    with torch.inference_mode():
        for i in range(chunks + 2):
            _sync(device)
            t = time.perf_counter()
            if vae is not None:
                z = vae.encode(x).latent_dist.mode()
                latents = torch.cat([latents[:, :, 1:], z[:, :, -1:]], dim=2)
            for _ in range(steps):
                flow = dit(latents, torch.full((1,), 500.0, device=device), context, return_dict=False)[0]
                latents = latents - 0.1 * flow
            if vae is not None:
                vae.decode(latents[:, :, -2:])
            _sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t)
    per_chunk = float(np.median(times))
    return {"fps": FRAMES_PER_CHUNK / per_chunk, "chunk_ms": per_chunk * 1000, "window_latents": window,
            "chunks": chunks}


def summary_table(result: dict[str, Any]) -> str:
    loom = result["loom"]
    lat = loom["latency_ms"]
    rows = [
        ("preset", result["preset"]),
        ("resolution", result["resolution"]),
        ("steps / mode", f"{result['steps']} / {loom['plan']['mode']} x{loom['plan']['chunk_latents']}"),
        ("vae enc/dec", result["vae"]),
        ("frames measured", loom["measured_frames"]),
        ("FPS", f"{loom['fps']:.2f}"),
        ("time to first frame", f"{loom['ttff_s']:.3f} s" if loom["ttff_s"] is not None else "-"),
        ("latency mean/p50/p90", _ms(lat, ("mean", "p50", "p90"))),
        ("latency p95/p99/max", _ms(lat, ("p95", "p99", "max"))),
        ("jitter latency/interval", f"{_f(loom['latency_jitter_ms'])} / {_f(loom['interval_jitter_ms'])} ms"),
        (f"SLO miss rate @{loom['slo_budget_ms']:.0f} ms", f"{100 * loom['slo_miss_rate']:.2f} %"),
    ]
    if loom["fps"] > 0:  # on a GPU the stages of neighbouring chunks share it: their spans overlap
        rows.append(("chunk period", f"{FRAMES_PER_CHUNK * 1000 / loom['fps']:.2f} ms per {FRAMES_PER_CHUNK} "
                                     "frames (stage spans below may overlap it)"))
    for stage, v in loom["stages_ms"].items():
        rows.append((f"stage {stage}", f"{v['mean']:.2f} ms/call"))
    for r in loom.get("ranks", []):  # the DiT pipeline over several GPUs
        stages = ", ".join(f"{k} {v['mean']:.2f}" for k, v in r["stages_ms"].items())
        rows.append((f"rank {r['rank']} {loom['placement'][r['rank']]}",
                     f"{stages} ms/call; waited {r['wait_s']:.2f} s"))
    if "ranks" in loom:
        rows.append(("block split / suggested", f"{loom['split']} / {loom['suggested_split']} "
                                                f"({loom.get('block_moves', 0)} live moves)"))
    if "bridge" in result and "error" in result["bridge"]:
        rows.append(("stage bridge", f"not measured: {result['bridge']['error']}"))
    elif "bridge" in result:
        b = result["bridge"]
        rows.append(("stage bridge", f"{b['mean_ms']:.2f} ms/frame (p50 {b['p50_ms']:.2f}, p99 {b['p99_ms']:.2f}; "
                                     f"{b['transport']} round trip, pass-through engine)"))
    if loom.get("gpu_memory_peak_bytes"):
        rows.append(("GPU memory peak", f"{loom['gpu_memory_peak_bytes'] / 2**30:.2f} GiB"))
    if loom.get("gpu_memory_reserved_peak_bytes"):
        cap = result.get("memory_cap_gib")
        rows.append(("GPU memory reserved, whole run", f"{loom['gpu_memory_reserved_peak_bytes'] / 2**30:.2f} GiB"
                     + (f" (capped at {cap:g} GiB)" if cap else "")))
    if "baseline" in result:
        b = result["baseline"]
        rows.append(("baseline (diffusers, eager)", f"{b['fps']:.2f} FPS ({b['chunk_ms']:.1f} ms/chunk)"))
        rows.append(("Loom / baseline", f"{loom['fps'] / b['fps']:.2f}x"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(lat: dict, keys: tuple[str, ...]) -> str:
    return " / ".join(_f(lat.get(k)) for k in keys) + " ms"


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """The results, whole or not at all (an earlier result at `path` stays until this one is written)."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2, default=str)
    write_replacing(path, lambda f: f.write(text.encode()))
