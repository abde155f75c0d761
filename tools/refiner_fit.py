"""Fit the embedded DiT's latent refiner alone on a CPU, to compare training losses without a GPU.

The trunk is frozen: training windows stream once through the shipped model (the recipe's `unroll`,
two steps, the default preset's list) and the refiner's inputs at the last step are kept; then only
the refiner learns, with the recipe's DiT-phase losses (`decoded_loss`, the latent loss of the last
step) and `--sharpness-loss W` and `--boundary-loss W` as the recipe's options of those names. The fitted
model is written as a weights file that `loom train eval --weights` reads, and its held-out figures
(the eval's default run) are printed. A probe for a loss's direction in minutes of CPU, not a
substitute for a training call: a refiner fitted this way sees a few hundred latents of one trunk.

    python tools/refiner_fit.py --out build/fit_plain.safetensors
    python tools/refiner_fit.py --sharpness-loss 1 --out build/fit_sharp.safetensors
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from loom_live.engine.models.dit_source import dit_source
from loom_live.engine.models.embedded import EMBEDDED_DIT, read_embedded, save_embedded
from loom_live.engine.models.wan_dit import WanDiT
from loom_live.engine.stream.schedule import FlowSchedule
from loom_live.engine.train.data import load_pairs
from loom_live.engine.train.recipe import (
    CHUNK,
    FIRST_CHUNK,
    STEP_LISTS,
    RecipeConfig,
    StyleConditions,
    Windows,
    continue_dit,
    decoded_loss,
    load_vae,
    motion_t0,
    stream_decode,
    stream_encode,
    unroll,
)
from loom_live.engine.train.styles import STYLE_NAMES


def capture(dit: WanDiT, vae, windows: Windows, cfg: RecipeConfig, n_windows: int, seed: int) -> list[dict]:
    """Each window's refiner inputs at the last step of every chunk, with its targets."""
    conds, schedule = StyleConditions(cfg.table, torch.device("cpu")), FlowSchedule(shift=cfg.timestep_shift)
    steps, frames = STEP_LISTS[2], FIRST_CHUNK + CHUNK * (cfg.dit_chunks - 1)
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    calls: list[tuple] = []
    hook = dit.head.refiner.register_forward_pre_hook(lambda _m, args: calls.append(
        tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)))
    out = []
    try:
        for i in range(n_windows):
            clip, s, flip = windows.sample(frames)
            style = i % len(STYLE_NAMES)
            src = windows.get(clip, 0, s, frames, flip)[None]
            tgt = windows.get(clip, 1 + style, s, frames, flip)[None]
            t0s = motion_t0(windows.motion[clip], s, cfg.dit_chunks, float(rng.uniform(*cfg.noise_scale)), True)
            with torch.no_grad():
                z_src, z_tgt = stream_encode(vae, src, cfg.dit_chunks), stream_encode(vae, tgt, cfg.dit_chunks)
                source = dit_source(dit.cfg, z_src, src)
                calls.clear()
                unroll(dit, schedule, z_src, [torch.tensor([t]) for t in t0s],
                       dit.cross_kv(conds.context(style)[None]), steps, cfg, gen, None, source)
            out.append({"style": style, "inputs": calls[len(steps) - 1::len(steps)], "z": z_tgt, "x": tgt})
            print(f"captured {i + 1}/{n_windows}", end="\r", flush=True)
    finally:
        hook.remove()
    print()
    return out


def fit(refiner: torch.nn.Module, vae, windows: list[dict], cfg: RecipeConfig, steps: int, batch: int,
        seed: int) -> list[float]:
    """Adam on the refiner alone (`cfg.dit_lr`), with the recipe's DiT-phase losses at `cfg`'s weights:
    the latent loss of the last step and `decoded_loss`."""
    refiner.train().requires_grad_(True)
    opt = torch.optim.AdamW(refiner.parameters(), lr=cfg.dit_lr, weight_decay=0.01)
    rng, losses = np.random.default_rng(seed), []
    for step in range(steps):
        loss = torch.zeros(())
        for j in rng.choice(len(windows), batch, replace=False):
            w = windows[j]
            z = torch.cat([refiner(*args) for args in w["inputs"]], dim=2)
            y = stream_decode(vae, z, clamp=False)
            loss = loss + (F.mse_loss(z, w["z"]) + decoded_loss(y, w["x"], cfg)) / batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0:
            print(f"step {step} loss {np.mean(losses[-10:]):.4f}", flush=True)
    refiner.eval().requires_grad_(False)
    return losses


def keep_stored(source: str, out: str, prefix: str = "dit.head.refiner.") -> None:
    """`out` with every tensor but the refiner's as `source` stores it: the trunk did not train, and
    storing it again would re-round its int8 scales (read back as float16) by a level here and there."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(source, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    with safe_open(out, framework="pt") as f:
        metadata = f.metadata()
        tensors.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    save_file(tensors, out, metadata=metadata)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="engine/models/weights/embedded.safetensors")
    p.add_argument("--data", default="build/loom_styles_256.npz")
    p.add_argument("--windows", type=int, default=60, help="training windows captured (6 per style)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--sharpness-loss", type=float, default=0.0)
    p.add_argument("--boundary-loss", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=int, default=25, help="held-out frames per clip for the figures (0: none)")
    p.add_argument("--capture", default="", help="keep the captured windows in this file, or read them from it")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(2)
    cfg = RecipeConfig(data=a.data, dit_lr=a.lr, sharpness_loss=a.sharpness_loss, boundary_loss=a.boundary_loss)
    dit = WanDiT(EMBEDDED_DIT)
    continue_dit(dit, a.weights)
    dit.eval().requires_grad_(False)
    vae = load_vae(a.weights, torch.device("cpu"))
    t = time.perf_counter()
    if a.capture and Path(a.capture).is_file():  # the same windows for every loss compared
        captured = torch.load(a.capture)
    else:
        windows = Windows(load_pairs(a.data)[1], torch.device("cpu"), a.seed)
        captured = capture(dit, vae, windows, cfg, a.windows, a.seed)
        if a.capture:
            torch.save(captured, a.capture)
    t_fit = time.perf_counter()
    losses = fit(dit.head.refiner, vae, captured, cfg, a.steps, a.batch, a.seed)
    earlier = {k: v for k, v in read_embedded(a.weights, check_hash=False)[2].items() if not k.startswith("latents_")}
    fitted = {**vars(a), "capture_s": round(t_fit - t, 1), "fit_s": round(time.perf_counter() - t_fit, 1),
              "last_loss": losses[-1]}
    meta = {**earlier, "refiner_fits": [*earlier.get("refiner_fits", []), fitted]}  # the file's history kept
    save_embedded(a.out, dit, vae, meta)
    keep_stored(a.weights, a.out)
    print(json.dumps(meta))
    if a.frames:
        from loom_live.engine.train.evaluate import STYLES, held_out, measure, summary

        print(json.dumps(summary(measure(held_out(a.frames), [], STYLES, a.out))))


if __name__ == "__main__":
    main()
