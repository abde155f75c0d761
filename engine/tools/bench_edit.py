"""`loom bench` for the edit family: the streaming session at each batch size, and the encoder alone.

The session numbers come from the same streaming loop as the Wan family's (`run_loom`): FPS,
latency percentiles, and per-stream stage times (side: preprocess, VAE encode, prompt encode;
main: UNet, VAE decode, postprocess). The encoder is then timed apart, at batch sizes 1, 8 and
16, to show how its cost per frame falls with the batch (the reason frames are batched), and part
by part as `edit.encoder_split` cuts a refresh: the longest part is the burst one UNet batch meets.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from loom_live.engine.config import LoomConfig
from loom_live.engine.tools.bench import _progress, run_loom, whole_span

ENCODER_BATCHES = (1, 8, 16)
ENCODER_ITERS = 10
# Published figures of the system this family follows (512x512, 1 step; docs/performance.md)
PUBLISHED = "RTX 3090 Ti: 27.4 FPS at B=8, 29.6 FPS at B=16 (p50 about 0.5 s / 1.0 s); 4090: 54.9; 5090: 74.1"


def edit_spans(cfg: LoomConfig, warmup: int, frames: int, batches: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """For each batch size B, the warm-up and measured frames for those asked, in whole batches of B (`whole_span`):
    the timed window then runs exactly the batches whose frames it counts."""
    return {b: whole_span(_at_batch(cfg, b), warmup, frames) for b in batches}


def run_edit(cfg: LoomConfig, frames: np.ndarray, spans: dict[int, tuple[int, int]],
             input_fps: float) -> dict[str, Any]:
    """One streaming run per batch size over its span (`edit_spans`), then the encoder's cost per frame by batch
    size."""
    runs = {}
    for b, (warmup, measured) in spans.items():
        _progress(f"edit family, B={b}")
        runs[b] = run_loom(_at_batch(cfg, b), frames[:warmup + measured], warmup, input_fps)
    encoder, device = _encoder(cfg)
    return {"runs": runs, "encoder_ms_per_frame": encoder_amortisation(cfg, encoder, device),
            "encoder_parts_ms": encoder_parts(cfg, encoder, device)}


def _at_batch(cfg: LoomConfig, batch: int) -> LoomConfig:
    return cfg.replace(edit=dataclasses.replace(cfg.edit, batch=batch))


def _encoder(cfg: LoomConfig) -> tuple[Any, torch.device]:
    from loom_live.engine.edit.loading import load_edit_encoder
    from loom_live.engine.models.loading import resolve_device, resolve_dtype

    device = resolve_device(cfg.model.device)
    return load_edit_encoder(cfg, device, resolve_dtype(cfg.model.dtype, device)), device


def encoder_amortisation(cfg: LoomConfig, encoder: Any, device: torch.device,
                         sizes: tuple[int, ...] = ENCODER_BATCHES) -> dict[int, dict[str, float]]:
    """Median time of one encoder call on B frames, and per frame, for each B."""
    from loom_live.engine.stream.stage_timer import median_cuda_ms

    out = {}
    for b in sizes:
        images = torch.rand(b, 3, cfg.resolution.height, cfg.resolution.width, device=device) * 2 - 1

        def call(images: torch.Tensor = images) -> object:
            return encoder.encode(cfg.prompt.text, images)

        with torch.inference_mode():
            ms = median_cuda_ms(call, ENCODER_ITERS) if device.type == "cuda" else _median_wall_ms(call)
        out[b] = {"batch_ms": ms, "per_frame_ms": ms / b}
    return out


def encoder_parts(cfg: LoomConfig, encoder: Any, device: torch.device, iters: int = ENCODER_ITERS) -> list[float]:
    """Median ms of each part of one refresh as the session cuts it (`edit.encoder_split`), on the
    frames a refresh reads (one, or the batch). A part reads what the one before left, so each is
    timed once per refresh, in order."""
    from loom_live.engine.stream.stage_timer import timed_ms

    b = 1 if cfg.edit.prompt_one_frame else cfg.edit.batch
    images = torch.rand(b, 3, cfg.resolution.height, cfg.resolution.width, device=device) * 2 - 1
    times: list[list[float]] = [[] for _ in range(cfg.edit.encoder_split)]
    with torch.inference_mode():
        for i in range(iters + 1):  # the first pays for lazy initialisation
            for part, spent in zip(encoder.encode_parts(cfg.prompt.text, images, cfg.edit.encoder_split), times):
                ms = timed_ms(part, device)
                if i:
                    spent.append(ms)
    return [float(np.median(t)) for t in times]


def _median_wall_ms(fn: Any, iters: int = 3) -> float:
    fn()  # the first call pays for lazy initialisation
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000.0)
    return float(np.median(times))


def edit_summary_table(result: dict[str, Any]) -> str:
    edit = result["edit"]
    e = result["config"]["edit"]
    rows = [("preset", result["preset"]), ("resolution", result["resolution"]),
            ("steps / hooks / encoder split", f"{e['steps']} / {e['lllite_hooks']} / {e['encoder_split']}")]
    for b, run in edit["runs"].items():
        lat = run["latency_ms"]
        rows.append((f"B={b} frames measured", f"{run['measured_frames']} after {run['warmup_frames']} warm-up"))
        rows.append((f"B={b} FPS", f"{run['fps']:.2f}"))
        rows.append((f"B={b} latency p50/p99", f"{_f(lat.get('p50'))} / {_f(lat.get('p99'))} ms"))
        for stage, v in run["stages_ms"].items():
            rows.append((f"B={b} stage {stage}", f"{v['mean']:.2f} ms/call, max {v['max']:.1f}, {v['count']} calls"))
    for b, v in edit["encoder_ms_per_frame"].items():
        rows.append((f"encoder at B={b}", f"{v['batch_ms']:.1f} ms/call, {v['per_frame_ms']:.2f} ms/frame"))
    rows.append(("encoder refresh by part", " + ".join(f"{ms:.1f}" for ms in edit["encoder_parts_ms"]) + " ms"))
    rows.append(("published (other GPUs)", PUBLISHED))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"
