"""The embedded model's training recipe: the VAE, then the causal DiT, streamed as Loom runs it.

Phase 1, the VAE (engine/models/frame_vae.py) as a streaming autoencoder: random windows of
source and styled clips go through `encode_stream` / `decode_stream` chunk by chunk (5 frames,
then 4), exactly the session's path, with an L1 + gradient-L1 + squared-error + brightness-relative
chroma loss on the raw (unclamped) output. Its latents are then normalised per channel (the
statistics ship in the weights' metadata). Optionally the decoder alone then trains on (`decoder_steps`),
which keeps the latent space and so a DiT trained on it. The reconstruction is measured on the
held-out clips when their data file is given (`eval_data`): the gate the DiT phase relies on.

Phase 2, the DiT (engine/models/wan_dit.py) for the inference Loom runs, unrolled over a stream:
a window of a source clip is cut into the session's chunks (5 frames, then 4: one latent each)
and VAE-encoded as a stream; each chunk's first timestep comes from a `MotionNoiseController`
fed the chunk's frames (random noise scale, motion-aware on or off); the chunk is noised with
the `FlowSchedule` and denoised through the step list of 1 to 4 steps that the hosts offer,
each step its own `KVCache` (sinks, ring, RoPE refresh and adaptive sinks as configured), in
sequential mode: what `StreamDenoiser.run_sequential` computes, for a batch of streams at once
(test_train_recipe checks the two agree). Every step's clean estimate is pulled towards the
styled clip's latent; the final one is also decoded and compared in pixels, and so are its
frame-to-frame changes (optionally those across chunk boundaries again, on their own, and each
block's edge energy: `sharpness_loss`). Gradients
flow through the cache across the whole unroll, so the model learns from its own cached keys. The
condition is the style's text vector (sometimes a blend of two styles with a blended target, so
prompt transitions are gradual; `style_weights` can show some styles more often than others).
"""

from __future__ import annotations

import json
import math
import os
import time
import zipfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from loom_live.engine.models.dit_source import dit_source
from loom_live.engine.models.embedded import (
    EMBEDDED_DIT,
    EMBEDDED_VAE,
    STYLE_TEXT_DIM,
    STYLE_TEXT_LEN,
    save_embedded,
)
from loom_live.engine.models.frame_vae import BLOCK_VALUES, FrameVAE
from loom_live.engine.models.wan_dit import WanDiT
from loom_live.engine.models.wan_vae import SPACE_STRIDE
from loom_live.engine.stream.motion_noise import MotionNoiseController, frame_difference_motion
from loom_live.engine.stream.prompts import blend
from loom_live.engine.stream.schedule import FlowSchedule
from loom_live.engine.train.data import SOURCE, Clip, load_pairs
from loom_live.engine.train.losses import (
    boundary_loss,
    chroma_loss,
    past_the_clamp,
    pixel_loss,
    sharpness_loss,
    temporal_loss,
)
from loom_live.engine.train.styles import STYLE_NAMES
from loom_live.host_bridge.wire.params import CHUNK_FRAMES, FIRST_CHUNK_FRAMES
from loom_live.host_bridge.wire.typed_config import spec

STEP_LISTS = {1: [700], 2: [700, 500], 3: [700, 500, 400], 4: [700, 500, 400, 200]}  # the hosts' lists
STEP_WEIGHTS = (0.25, 0.4, 0.2, 0.15)  # 2 steps is the default preset
FIRST_CHUNK, CHUNK = FIRST_CHUNK_FRAMES, CHUNK_FRAMES  # the session's chunks, in frames
# The folder holding engine/: the checkout, or installed the package's. The shipped table is read from it; no
# default writes there (`loom train` writes into `cli.defaults_root`).
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RecipeConfig:
    """Everything a training run depends on (written next to the weights). Each field's `doc` is its
    `loom train fit --help` text."""

    data: str = spec("build/loom_styles_256.npz", doc="the training clips (`loom train prepare` writes them)")
    eval_data: str = spec("build/loom_heldout_256.npz",
                          doc="held-out clips and styles: the VAE gate (skipped if absent)")
    vae_from: str = spec("", doc="a weights file of an earlier run: reuse its VAE, skip phase 1 (default: none)")
    dit_from: str = spec("", doc="a weights file of an earlier run: go on training its DiT (default: none)")
    table: str = spec("engine/models/weights/style_text.npz",
                      doc="the style text table; the shipped one is found beside the package from any folder")
    out: str = spec("build/embedded", doc="folder of the weights, recipe.json and train_log.jsonl")
    vae_seconds: float = spec(150.0, doc="seconds of VAE training (with --vae-from: none)")
    dit_seconds: float = spec(330.0, doc="seconds of DiT training (0: none)")
    vae_batch: int = spec(32, doc="windows in each VAE step")
    vae_chunks: int = spec(2, doc="chunks in each VAE window (5 frames, then 4)")
    decoder_steps: int = spec(0, doc="> 0: then tune the VAE's decoder alone this many steps (the latent space stays)")
    chroma_loss: float = spec(1.0, doc="weight of the brightness-relative chroma loss in both VAE phases")
    dit_batch: int = spec(48, doc="streams in each DiT step (halved and retried when out of GPU memory)")
    pixel_batch: int = spec(16, doc="of which this many also get the decoded-pixel loss")
    dit_chunks: int = spec(7, doc="chunks in each DiT stream: the first (5 frames, 2 latents) + 6 more: past one "
                                  "ring wrap")
    vae_lr: float = spec(1e-3, doc="the VAE's peak learning rate (cosine decay over the phase)")
    dit_lr: float = spec(7e-4, doc="the DiT's peak learning rate (cosine decay over the phase)")
    timestep_shift: float = spec(0.25, doc="sigma shift of the flow schedule in training")
    noise_scale: tuple[float, float] = spec((0.45, 1.0), doc="range each stream's noise scale is drawn from")
    motion_aware_p: float = spec(0.8, doc="share of streams whose first timesteps are motion-aware")
    blend_p: float = spec(0.15, doc="share of streams conditioned on a blend of two styles (and blended targets)")
    switch_p: float = spec(0.25, doc="share of batches whose prompt changes mid-stream, blended over 0-4 chunks as "
                                     "the session does")
    edge_drop_p: float = spec(0.2, doc="share of windows whose edges get a random scale: the live edge control")
    num_kv_cache: int = spec(6, doc="latent frames kept in the KV window")
    sink: int = spec(3, doc="of which sink frames kept from the stream start")
    sink_threshold: float = spec(0.2, doc="adaptive sink cosine threshold; < 0 disables")
    rope_refresh_at: int = spec(50, doc="latent-frame index at which the RoPE refresh moves back")
    pixel_loss: float = spec(1.0, doc="weight of the loss on the decoded pixels")
    temporal_loss: float = spec(2.0, doc="weight of the frame-to-frame change loss on the decoded pixels")
    boundary_loss: float = spec(0.0, doc="weight of the same loss on the frame pairs across chunk boundaries alone")
    sharpness_loss: float = spec(0.0, doc="weight of the edge-energy and block-grid loss on the decoded pixels")
    style_weights: str = spec("", doc='"name=w,...": each style\'s share of the DiT\'s windows (unnamed: 1) '
                                      '(default: uniform)')
    seed: int = spec(0, doc="seed of the windows, styles and noise drawn")
    max_steps: int = spec(0, doc="> 0: stop after this many steps per phase (dry runs)")


# RecipeConfig's working files: `loom train` defaults them under one folder (`cli.defaults_root`), so that
# prepare, fit and eval find each other's files wherever they are run from.
WORKING_FILES = ("data", "eval_data", "out")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_config(cfg: RecipeConfig) -> None:
    """Refuse settings a run cannot use, before it loads or trains anything, naming what is allowed (a batch
    of 0 or a budget below 0 would otherwise fail deep in a phase, or after the VAE phase's minutes)."""
    rules = {"vae_seconds": (0, "a number of seconds, 0 or more"), "dit_seconds": (0, "a number of seconds, 0 or more"),
             "vae_batch": (1, "1 or more"), "dit_batch": (1, "1 or more"), "pixel_batch": (1, "1 or more"),
             "vae_chunks": (1, "1 or more (5 frames, then 4 a chunk)"),
             "dit_chunks": (2, "2 or more (the first chunk of 5 frames and at least one of 4)"),
             "decoder_steps": (0, "0 (none) or more"), "max_steps": (0, "0 (no limit) or more")}
    rules.update(dict.fromkeys(("chroma_loss", "pixel_loss", "temporal_loss", "boundary_loss", "sharpness_loss"),
                               (0, "a weight, 0 (off) or more")))
    for name, (low, allowed) in rules.items():
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value >= low):
            raise ValueError(f"{_option(name)} {value}: expected {allowed}")
    for name in ("vae_lr", "dit_lr"):
        value = getattr(cfg, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{_option(name)} {value}: expected a number above 0")
    for name in ("motion_aware_p", "blend_p", "switch_p", "edge_drop_p"):
        value = getattr(cfg, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{_option(name)} {value}: expected a share from 0 to 1")


def check_windows(cfg: RecipeConfig, clips: list[Clip], path: str) -> None:
    """Every clip must hold a whole training window of each phase that will run."""
    shortest = min(len(c.frames[SOURCE]) for c in clips)
    most = 1 + (shortest - FIRST_CHUNK) // CHUNK  # chunks in the shortest clip
    for name, runs in (("vae_chunks", not cfg.vae_from and cfg.vae_seconds > 0 or cfg.decoder_steps > 0),
                       ("dit_chunks", cfg.dit_seconds > 0)):
        if runs and getattr(cfg, name) > most:
            raise ValueError(f"{_option(name)} {getattr(cfg, name)}: {path}'s shortest clip has {shortest} frames, "
                             f"room for at most {most} chunks (5 frames, then 4 a chunk)")


class Windows:
    """Random training windows (on the device, uint8) from the decoded pairs."""

    def __init__(self, clips: list[Clip], device: torch.device, seed: int) -> None:
        self.variants = (SOURCE, *STYLE_NAMES)
        self.data = [torch.from_numpy(np.stack([c.frames[v] for v in self.variants])).to(device) for c in clips]
        self.rng = np.random.default_rng(seed)
        self.device = device
        self.motion = [self._pair_motion(i) for i in range(len(self.data))]

    def _pair_motion(self, clip: int) -> np.ndarray:
        """d of every consecutive source frame pair (the session's estimate, per pair): a chunk's
        d is the largest of its pairs', which is what `frame_difference_motion` gives the chunk."""
        x = self.get(clip, 0, 0, self.data[clip].shape[1], False).transpose(0, 1)  # [T, 3, H, W]
        pairs = [frame_difference_motion(x[t:t + 1], x[t - 1]) for t in range(1, len(x))]
        return np.concatenate([[0.0], torch.stack(pairs).cpu().numpy()])

    def sample(self, frames: int) -> tuple[int, int, bool]:
        clip = int(self.rng.integers(len(self.data)))
        start = int(self.rng.integers(self.data[clip].shape[1] - frames + 1))
        return clip, start, bool(self.rng.random() < 0.5)

    def get(self, clip: int, variant: int, start: int, frames: int, flip: bool) -> torch.Tensor:
        """[3, T, H, W] in [-1, 1] (float32)."""
        x = self.data[clip][variant, start:start + frames].permute(3, 0, 1, 2).float().div(127.5).sub(1.0)
        return x.flip(-1) if flip else x


def chunks_of(x: torch.Tensor, n_chunks: int, dim: int = 2) -> list[torch.Tensor]:
    sizes = [FIRST_CHUNK] + [CHUNK] * (n_chunks - 1)
    return list(x.split(sizes, dim=dim))


def stream_encode(vae: FrameVAE, x: torch.Tensor, n_chunks: int) -> torch.Tensor:
    state = vae.new_stream_state()
    return torch.cat([vae.encode_stream(c, state) for c in chunks_of(x, n_chunks)], dim=2)


def stream_decode(vae: FrameVAE, z: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    state = vae.new_stream_state()
    return torch.cat([vae.decode_stream(z[:, :, i:i + 1], state, clamp) for i in range(z.shape[2])], dim=2)


def style_shares(spec: str) -> np.ndarray | None:
    """Each style's probability from `RecipeConfig.style_weights` ("neon_edges=3,blueprint=2"; a style
    not named weighs 1), or None for uniform. The styles drawn along the input's edges learn slowest,
    and showing them more often is the cheapest way to give them more of a call's steps."""
    if not spec.strip():
        return None
    weights = dict.fromkeys(STYLE_NAMES, 1.0)
    for item in spec.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if name not in weights or not sep:
            raise ValueError(f"style_weights: {item.strip()!r} is not name=weight with a style of "
                             f"{', '.join(STYLE_NAMES)}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"style_weights: {name}'s weight {value.strip()!r} is not a number") from None
        if not weights[name] >= 0.0:
            raise ValueError(f"style_weights: {name}'s weight must be 0 or more, not {value.strip()}")
    total = sum(weights.values())
    if total <= 0.0:
        raise ValueError("style_weights: at least one style needs a weight above 0")
    return np.array([weights[n] / total for n in STYLE_NAMES])


def decoded_loss(y: torch.Tensor, x: torch.Tensor, cfg: RecipeConfig) -> torch.Tensor:
    """The DiT phase's losses on its decoded output y against the styled frames x, at `cfg`'s weights
    (a loss at weight 0 is not computed)."""
    loss = cfg.pixel_loss * pixel_loss(y, x) + cfg.temporal_loss * temporal_loss(y, x)
    if cfg.boundary_loss:
        loss = loss + cfg.boundary_loss * boundary_loss(y, x)
    if cfg.sharpness_loss:
        loss = loss + cfg.sharpness_loss * sharpness_loss(y, x)
    return loss


def vae_loss(y: torch.Tensor, x: torch.Tensor, cfg: RecipeConfig) -> torch.Tensor:
    return pixel_loss(y, x) + F.mse_loss(past_the_clamp(y, x), x) + cfg.chroma_loss * chroma_loss(y, x)


def vae_batch(cfg: RecipeConfig, windows: Windows, frames: int, source_p: float = 0.3) -> torch.Tensor:
    """Random windows: a source with probability `source_p`, else one of the styles."""
    rng, batch = windows.rng, []
    for _ in range(cfg.vae_batch):
        clip, s, flip = windows.sample(frames)
        variant = 0 if rng.random() < source_p else int(rng.integers(1, len(windows.variants)))
        batch.append(windows.get(clip, variant, s, frames, flip))
    return torch.stack(batch)


# --------------------------------------------------------------------------------------- phase 1
@torch.no_grad()
def principal_init(vae: FrameVAE, windows: Windows, frames: int = 256) -> None:
    """Set the VAE's linear block codec to the principal components of 8x8 blocks of random training
    frames (all variants): training starts from the best linear codec of this width, not a random one."""
    rng = np.random.default_rng(0)
    picks = []
    for _ in range(frames):
        clip = int(rng.integers(len(windows.data)))
        variant, t = int(rng.integers(len(windows.variants))), int(rng.integers(windows.data[clip].shape[1]))
        picks.append(windows.get(clip, variant, t, 1, False)[:, 0])
    blocks = F.pixel_unshuffle(torch.stack(picks), SPACE_STRIDE).permute(0, 2, 3, 1).reshape(-1, BLOCK_VALUES)
    blocks = blocks.double().cpu()
    mean = blocks.mean(0)
    _, vectors = torch.linalg.eigh(torch.cov((blocks - mean).T))
    basis = vectors.flip(1)[:, :vae.cfg.frame_channels]  # [192, k], largest variance first
    enc, dec = vae.encoder.linear, vae.decoder.linear
    enc.weight.copy_(basis.T.reshape(enc.weight.shape).float())
    enc.bias.copy_((-basis.T @ mean).float())
    dec.weight.copy_(basis.reshape(dec.weight.shape).float())
    dec.bias.copy_(mean.float())


def train_vae(cfg: RecipeConfig, windows: Windows, device: torch.device, log) -> FrameVAE:
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    vae = FrameVAE(replace(EMBEDDED_VAE, normalize_on_encode=False, denormalize_on_decode=False)).to(device)
    principal_init(vae, windows)
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    frames = FIRST_CHUNK + CHUNK * (cfg.vae_chunks - 1)
    start, step = time.perf_counter(), 0
    bar = tqdm(desc="vae", unit="step")
    while time.perf_counter() - start < cfg.vae_seconds and not (cfg.max_steps and step >= cfg.max_steps):
        x = vae_batch(cfg, windows, frames)
        frac = (time.perf_counter() - start) / cfg.vae_seconds
        for g in opt.param_groups:
            g["lr"] = cfg.vae_lr * _cosine(frac)
        z = stream_encode(vae, x, cfg.vae_chunks)
        y = stream_decode(vae, z, clamp=False)
        loss = vae_loss(y, x, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        bar.update()
        if step % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
            log({"phase": "vae", "step": step, "loss": loss.item(), "t": time.perf_counter() - start})
    bar.close()
    return vae.eval().requires_grad_(False)


def tune_decoder(cfg: RecipeConfig, windows: Windows, vae: FrameVAE, log) -> FrameVAE:
    """Train the (normalised) VAE's decoder alone for `cfg.decoder_steps`, at a tenth of the VAE's
    learning rate: the encoder and so the latent space stay as they are, so a DiT trained on them
    still fits, while the decoder learns what the VAE phase's loss missed (dark colours: `chroma_loss`)."""
    from tqdm import tqdm

    vae.decoder.train().requires_grad_(True)
    opt = torch.optim.AdamW(vae.decoder.parameters(), lr=cfg.vae_lr / 10, weight_decay=0.0)
    frames = FIRST_CHUNK + CHUNK * (cfg.vae_chunks - 1)
    for step in tqdm(range(1, cfg.decoder_steps + 1), desc="decoder", unit="step"):
        x = vae_batch(cfg, windows, frames, source_p=0.1)
        with torch.no_grad():
            z = stream_encode(vae, x, cfg.vae_chunks)
        loss = vae_loss(stream_decode(vae, z, clamp=False), x, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 50 == 0:
            log({"phase": "decoder", "step": step, "loss": loss.item()})
    vae.decoder.eval().requires_grad_(False)
    return vae


@torch.no_grad()
def latent_stats(vae: FrameVAE, windows: Windows) -> tuple[list[float], list[float]]:
    zs = []
    for clip in range(len(windows.data)):
        for v in range(len(windows.variants)):
            x = windows.get(clip, v, 0, FIRST_CHUNK + CHUNK * 8, False)[None]
            zs.append(stream_encode(vae, x, 9).transpose(0, 1).flatten(1))
    z = torch.cat(zs, dim=1)
    return z.mean(1).tolist(), z.std(1).clamp_min(1e-3).tolist()


# --------------------------------------------------------------------------------------- phase 2
TABLE = RecipeConfig.table


def table_path(table: str | Path) -> Path:
    """The style table: as given when it exists there, else (the shipped table named relative to the source
    tree) beside the package, so a run from another folder finds it."""
    path = Path(table).expanduser()
    if path.is_file() or path.is_absolute():
        return path
    beside = PACKAGE_ROOT / path
    return beside if beside.is_file() else path


class StyleConditions:
    """The style condition vectors (from the shipped text table) as DiT contexts [B, L, dim]."""

    def __init__(self, table: str | Path, device: torch.device) -> None:
        table = table_path(table)
        if not table.is_file():
            raise FileNotFoundError(f"--table {table}: no such file; the shipped one is {table_path(TABLE)}")
        try:
            with np.load(table) as t:
                names, condition = [str(s) for s in t["styles"]], t["condition"]
        except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise ValueError(f"--table {table}: not a style table of `loom train table` ({exc})") from None
        if names != list(STYLE_NAMES):
            raise ValueError(f"{table}: styles {names} differ from engine.train.styles {STYLE_NAMES}")
        if condition.shape != (len(STYLE_NAMES), STYLE_TEXT_DIM):
            raise ValueError(f"--table {table}: condition vectors of shape {list(condition.shape)}; the DiT "
                             f"reads {len(STYLE_NAMES)} of {STYLE_TEXT_DIM} values (`loom train table` makes them)")
        self.vectors = torch.from_numpy(condition.astype(np.float32)).to(device)

    def contexts(self, a: int, b: int, weights: list[float]) -> list[torch.Tensor]:
        return [self.context(a, b, w) if 0 < w < 1 else self.context(b if w >= 1 else a) for w in weights]

    def context(self, a: int, b: int | None = None, w: float = 0.0) -> torch.Tensor:
        v = self.vectors[a] if b is None else blend(self.vectors[a][None], self.vectors[b][None], w, "slerp")[0]
        ctx = torch.zeros(STYLE_TEXT_LEN, v.shape[-1], device=v.device)
        ctx[0] = v
        return ctx


def noise_like(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)


def first_sigma(schedule: FlowSchedule, t0: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """The chunk's first sigma, clamped as `StreamDenoiser._first_sigma` does."""
    lo = steps[1] + 1 if len(steps) > 1 else 1
    return schedule.sigma(t0.clamp(lo, schedule.train_timesteps - 1))


def unroll(dit: WanDiT, schedule: FlowSchedule, z: torch.Tensor, t0: list[torch.Tensor], cross, steps: list[int],
           cfg: RecipeConfig, gen: torch.Generator, on_step=None, source: torch.Tensor | None = None
           ) -> list[torch.Tensor]:
    """Stream the source latents z [B, C, F, h, w] chunk by chunk (2 latents, then 1) through the
    step list, one KV cache per step (sequential mode); returns each chunk's clean latent.
    `cross` is one prompt's CrossKV, or a list of one per chunk (a prompt change mid-stream).
    `on_step(chunk, step, x0)` sees every step's clean estimate (the training losses). `source`: what
    a DiT that reads its input gets beside each chunk (`dit_source` of the whole clip; default z)."""
    b, _, f, h, w = z.shape
    sizes = [2] + [1] * (f - 2)
    sources = (z if source is None else source).split(sizes, dim=2)
    caches = [dit.new_cache(b, (h, w), num_kv_cache=cfg.num_kv_cache, sink=cfg.sink, rope_policy="refresh",
                            refresh_at=cfg.rope_refresh_at, sink_threshold=cfg.sink_threshold)
              for _ in steps]
    sigmas = [schedule.sigma(s) for s in steps]
    out = []
    for c, zc in enumerate(z.split(sizes, dim=2)):
        given = {"source": sources[c]} if dit.cfg.source_channels else {}
        sigma0 = first_sigma(schedule, t0[c], steps)
        x = schedule.add_noise(zc, noise_like(zc, gen), sigma0)
        for i, cache in enumerate(caches):
            sig = sigma0 if i == 0 else torch.full((b,), sigmas[i], device=z.device)
            flow = dit.forward_stream(x, sig * schedule.train_timesteps, cache,
                                      cross[c] if isinstance(cross, list) else cross, **given)
            x0 = schedule.to_x0(x, flow.float(), sig)
            if on_step is not None:
                on_step(c, i, x0)
            if i + 1 < len(steps):
                x = schedule.add_noise(x0, noise_like(x0, gen), sigmas[i + 1])
        out.append(x0)
    return out


def motion_t0(pair_d: np.ndarray, start: int, n_chunks: int, noise_scale: float, motion_aware: bool
              ) -> list[float]:
    """Per chunk, the first step the session's `MotionNoiseController` gives a stream that starts at
    frame `start` (pair_d: the clip's per-pair motion, see `Windows`)."""
    ctl = MotionNoiseController(noise_scale, enabled=motion_aware)
    out, lo = [], start
    for size in [FIRST_CHUNK] + [CHUNK] * (n_chunks - 1):
        hi = lo + size
        first = lo + 1 if lo == start else lo  # a later chunk also compares with the previous chunk's last frame
        d = float(pair_d[first:hi].max(initial=0.0))
        out.append(ctl.first_step(ctl.advance(d) if motion_aware else ctl.update(None, None)))
        lo = hi
    return out


def edge_scales(rng: np.random.Generator, batch: int, p: float, device: torch.device) -> torch.Tensor:
    """Per window, the scale of the edges the DiT reads (`control.context_scale` of a session): share `p`
    get a random one, the rest 1 (as streamed by default, so most of the batch still learns the model's
    default). Of the random ones half are 0: the control's off position, where the model must restyle from
    the codes alone (it cannot learn that from a scale that is never 0); half are uniform in [0, 1.5], so
    the scales between off and on, and a little beyond, are each a point it was trained at and a live
    slider moves smoothly (the schema's 1.5-2 is left to extrapolation: the line styles' lines get no
    more edge to draw from)."""
    drop = rng.random(batch) < p
    off = rng.random(batch) < 0.5
    scales = np.where(drop, np.where(off, 0.0, rng.uniform(0.0, 1.5, batch)), 1.0)
    return torch.tensor(scales, dtype=torch.float32, device=device)


def switch_weights(at: int, span: int, n_chunks: int) -> list[float]:
    """Per chunk, the new prompt's blend weight when it arrives at chunk `at` with
    transition_chunks=`span` (what `PromptConditioner.advance` gives)."""
    return [0.0 if c < at else 1.0 if span == 0 else min(1.0, (c - at + 1) / span) for c in range(n_chunks)]


def frame_weights(w: list[float], device: torch.device) -> torch.Tensor:
    """Chunk weights spread over the chunks' frames, shaped to lerp [3, T, H, W] frames."""
    sizes = [FIRST_CHUNK] + [CHUNK] * (len(w) - 1)
    return torch.tensor([wc for wc, k in zip(w, sizes) for _ in range(k)], device=device)[None, :, None, None]


def train_dit(cfg: RecipeConfig, windows: Windows, vae: FrameVAE, dit: WanDiT, device: torch.device, log,
              save=None) -> WanDiT:
    from tqdm import tqdm

    dit.train().requires_grad_(True)
    conds = StyleConditions(cfg.table, device)
    schedule = FlowSchedule(shift=cfg.timestep_shift)
    opt = torch.optim.AdamW(dit.parameters(), lr=cfg.dit_lr, weight_decay=0.01)
    gen = torch.Generator(device).manual_seed(cfg.seed)
    frames = FIRST_CHUNK + CHUNK * (cfg.dit_chunks - 1)
    rng = windows.rng
    edge_rng = np.random.default_rng([cfg.seed, 1])  # its own draws: the windows, styles and noise stay the seed's
    n_styles = len(STYLE_NAMES)
    shares = style_shares(cfg.style_weights)
    start, step = time.perf_counter(), 0
    bar = tqdm(desc="dit", unit="step")
    def train_step(batch: int) -> tuple[torch.Tensor, int]:
        n = int(rng.choice(4, p=STEP_WEIGHTS)) + 1
        steps = STEP_LISTS[n]
        switch = rng.random() < cfg.switch_p
        src, tgt, ctx, t0s = [], [], [], []
        for _ in range(batch):
            clip, s, flip = windows.sample(frames)
            a = int(rng.integers(n_styles)) if shares is None else int(rng.choice(n_styles, p=shares))
            x = windows.get(clip, 0, s, frames, flip)
            y = windows.get(clip, 1 + a, s, frames, flip)
            if switch:  # the prompt changes at chunk `at`, blended in over `span` chunks
                b = int(rng.integers(n_styles))
                w = switch_weights(int(rng.integers(1, cfg.dit_chunks)), int(rng.choice([0, 1, 2, 4])), cfg.dit_chunks)
                y = torch.lerp(y, windows.get(clip, 1 + b, s, frames, flip), frame_weights(w, device))
                ctx.append(torch.stack(conds.contexts(a, b, w)))
            elif rng.random() < cfg.blend_p:  # a blend of two styles: blended condition and target
                b, w = int(rng.integers(n_styles)), float(rng.uniform(0.0, 1.0))
                y = torch.lerp(y, windows.get(clip, 1 + b, s, frames, flip), w)
                ctx.append(conds.context(a, b, w))
            else:
                ctx.append(conds.context(a))
            src.append(x)
            tgt.append(y)
            scale = float(rng.uniform(*cfg.noise_scale))
            t0s.append(motion_t0(windows.motion[clip], s, cfg.dit_chunks, scale,
                                 bool(rng.random() < cfg.motion_aware_p)))
        src, tgt = torch.stack(src), torch.stack(tgt)
        t0 = [torch.tensor([t[c] for t in t0s], device=device) for c in range(cfg.dit_chunks)]
        with torch.no_grad():
            z_src = stream_encode(vae, src, cfg.dit_chunks)
            z_tgt = stream_encode(vae, tgt, cfg.dit_chunks)
            source = dit_source(dit.cfg, z_src, src, edge_scales(edge_rng, len(src), cfg.edge_drop_p, device))
        if switch:
            per_chunk = torch.stack(ctx)  # [B, chunks, L, dim]
            cross = [dit.cross_kv(per_chunk[:, c]) for c in range(cfg.dit_chunks)]
        else:
            cross = dit.cross_kv(torch.stack(ctx))
        frac = (time.perf_counter() - start) / cfg.dit_seconds
        for g in opt.param_groups:
            g["lr"] = cfg.dit_lr * _cosine(frac)
        targets = z_tgt.split([2] + [1] * (z_tgt.shape[2] - 2), dim=2)
        losses = []

        def on_step(c, i, x0, targets=targets, losses=losses, n=n):
            losses.append((0.5 if i + 1 < n else 1.0) * F.mse_loss(x0, targets[c]))

        out = unroll(dit, schedule, z_src, t0, cross, steps, cfg, gen, on_step, source)
        loss = torch.stack(losses).sum() / cfg.dit_chunks
        if cfg.pixel_loss:
            k = cfg.pixel_batch
            loss = loss + decoded_loss(stream_decode(vae, torch.cat(out, dim=2)[:k], clamp=False), tgt[:k], cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), 1.0)
        opt.step()
        return loss, n

    batch = cfg.dit_batch
    while time.perf_counter() - start < cfg.dit_seconds and not (cfg.max_steps and step >= cfg.max_steps):
        try:
            loss, n = train_step(batch)
        except torch.OutOfMemoryError:  # a long step list at this batch does not fit: go on with half
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            batch = max(8, batch // 2)
            log({"phase": "dit", "out_of_memory": True, "batch": batch})
            continue
        step += 1
        bar.update()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}", steps=n)
            mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            log({"phase": "dit", "step": step, "loss": loss.item(), "steps": n, "batch": batch,
                 "t": time.perf_counter() - start, "peak_gib": round(mem, 1)})
        if save is not None and step % 200 == 0:  # a run cut short still leaves weights
            save(dit, {"partial_step": step})
    bar.close()
    return dit.eval().requires_grad_(False)


def _cosine(frac: float, warmup: float = 0.03) -> float:
    if frac < warmup:
        return frac / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (frac - warmup) / (1 - warmup)))) * 0.95 + 0.05


# --------------------------------------------------------------------------------------- driver
def normalised(vae: FrameVAE, mean: list[float], std: list[float]) -> FrameVAE:
    """The trained VAE with its latent statistics, normalising on encode and undoing it on decode."""
    out = FrameVAE(replace(EMBEDDED_VAE, latents_mean=tuple(mean), latents_std=tuple(std)))
    out.load_state_dict(vae.state_dict())
    return out.to(next(vae.parameters()).device).eval().requires_grad_(False)


def read_weights(path: str, option: str) -> tuple[dict, dict, dict]:
    """(dit state, vae state, metadata) of an earlier run's weights file named by `option`; a missing,
    truncated or foreign file is a one-line error naming the option."""
    from safetensors import SafetensorError

    from loom_live.engine.models.embedded import read_embedded

    if not Path(path).is_file():
        raise FileNotFoundError(f"{option} {path}: no such file (an earlier run's OUT/embedded.safetensors "
                                "or OUT/embedded.partial.safetensors)")
    try:
        return read_embedded(path, check_hash=False)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{option} {path}: not a readable weights file ({exc})") from None


def load_vae(path: str, device: torch.device) -> FrameVAE:
    """The normalised VAE of an earlier run's weights file (its DiT may be of an earlier layout)."""
    from loom_live.engine.models.embedded import vae_config

    _, state, meta = read_weights(path, "--vae-from")
    try:
        vae = FrameVAE(vae_config(meta))
        vae.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except (KeyError, RuntimeError, ValueError) as exc:
        detail = [line.strip() for line in str(exc).splitlines() if line.strip()][-1]
        raise ValueError(f"--vae-from {path}: not weights of the embedded VAE's layout ({detail})") from None
    return vae.to(device).eval().requires_grad_(False)


def continue_dit(dit: WanDiT, path: str) -> list[str]:
    """Load an earlier run's DiT into `dit`. Its source may have grown (source latents where there were
    none, or edges beside each frame slot's codes, engine/models/dit_source.py): the patch embedding
    and the refiner's first layer keep every earlier weight at its input's new place and the new inputs
    start at zero, so the DiT starts as the earlier one. A refiner that gains the style layer keeps its
    weights and starts that layer at zero (the same); one of another width or slot layout starts afresh
    (its last layer at zero: the same). Any other difference is an error. Returns the names that
    started afresh or grew."""
    state, _, _ = read_weights(path, "--dit-from")
    own = dit.state_dict()
    cfg = dit.cfg
    embed, inp = "patch_embedding.weight", "head.refiner.inp.weight"
    old_width = state[embed].shape[1] if embed in state else own[embed].shape[1]  # absent: the load names it
    old_source = old_width - cfg.in_channels
    if not 0 <= old_source <= cfg.source_channels or old_source % cfg.refiner_slots:
        raise ValueError(f"{path}: its DiT's source of {old_source} channels cannot grow into "
                         f"{cfg.source_channels}")
    slots = cfg.refiner_slots
    old_slot, new_slot = old_source // slots, cfg.source_channels // slots
    grown = _widen(state, own, embed, _grown_columns(cfg.in_channels, old_slot, new_slot, slots, old_width))
    refiner = "head.refiner."
    if inp in state and inp in own and old_slot:
        per = cfg.out_channels // slots
        grown += _widen(state, own, inp, _grown_columns(2 * per, old_slot, new_slot, 1, state[inp].shape[1]))
    style = {k for k in own if k.startswith(refiner + "style.") and k not in state}  # gained: starts at zero
    changed = {k for k in set(state) | set(own) if k.startswith(refiner) and k not in style
               and (k not in state or k not in own or state[k].shape != own[k].shape)}
    if changed:
        state = {k: v for k, v in state.items() if not k.startswith(refiner)}
        grown = [k for k in grown if not k.startswith(refiner)]
    try:
        missing, unexpected = dit.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a tensor of another shape: another layout
        detail = [line.strip() for line in str(exc).splitlines() if line.strip()][-1]
        raise ValueError(f"{path}: its DiT does not fit the embedded preset ({detail})") from None
    fresh = sorted(k for k in own if k.startswith(refiner)) if changed else sorted(style)
    missing = [k for k in missing if k not in style]
    if any(not k.startswith(refiner) for k in missing) or unexpected or (missing and not changed):
        raise ValueError(f"{path}: its DiT does not fit the embedded preset: missing {missing}, "
                         f"unexpected {unexpected}")
    return grown + fresh


def _grown_columns(lead: int, old_slot: int, new_slot: int, slots: int, old_width: int) -> torch.Tensor:
    """Where each of a layer's `old_width` inputs goes when its source part grows: the first `lead`
    stay, slot s's k-th source input moves to slot s's k-th place in the wider layout, and whatever
    follows the source moves along by the growth."""
    cols = torch.arange(old_width)
    src = (cols >= lead) & (cols < lead + slots * old_slot)
    k = cols - lead
    moved = torch.where(src, lead + (k // max(old_slot, 1)) * new_slot + k % max(old_slot, 1),
                        cols + slots * (new_slot - old_slot))
    return torch.where(cols < lead, cols, moved)


def _widen(state: dict, own: dict, key: str, columns: torch.Tensor) -> list[str]:
    """Put `state[key]`'s input channels (in place) at `columns` of a zero tensor of `own[key]`'s shape."""
    old, new = state.get(key), own[key]
    if old is None or old.shape == new.shape:
        return []
    if old.shape[0] != new.shape[0] or old.shape[2:] != new.shape[2:] or int(columns.max()) >= new.shape[1]:
        return []  # another layout altogether: the caller's shape checks name it
    wide = torch.zeros(new.shape, dtype=old.dtype)
    wide[:, columns] = old
    state[key] = wide
    return [key]


def run(cfg: RecipeConfig) -> Path:
    """Train and write OUT/embedded.safetensors. Checkpoints along the way (after the VAE phase, every 200
    DiT steps) go to OUT/embedded.partial.safetensors; the finished model replaces OUT/embedded.safetensors
    only at the end, so a run that fails or is stopped never replaces weights an earlier run made there."""
    check_config(cfg)  # a setting out of range fails here, before the data load and any training
    style_shares(cfg.style_weights)  # so does a bad spec
    StyleConditions(cfg.table, torch.device("cpu"))  # and a missing or wrong table, not after the VAE phase
    if not Path(cfg.data).is_file():
        raise FileNotFoundError(f"--data {cfg.data}: no such file (`loom train prepare` makes it)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = False  # many shapes, few steps each: autotuning does not pay
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: a file; fit writes a folder (the weights, recipe.json, train_log.jsonl)")
    out.mkdir(parents=True, exist_ok=True)
    log_file = (out / "train_log.jsonl").open("a")  # each run adds its records; an earlier run's log stays

    def log(rec: dict) -> None:
        log_file.write(json.dumps(rec) + "\n")
        log_file.flush()

    t_start = time.perf_counter()
    log({"phase": "start", "recipe": asdict(cfg)})
    torch.manual_seed(cfg.seed + 1)
    dit = WanDiT(EMBEDDED_DIT).to(device)
    if cfg.dit_from:  # the earlier weights are read before the data: a wrong file fails at once
        fresh = continue_dit(dit, cfg.dit_from)
        log({"phase": "dit_from", "path": cfg.dit_from, "fresh": fresh})
    vae = load_vae(cfg.vae_from, device) if cfg.vae_from else None
    _, clips = load_pairs(cfg.data)
    check_windows(cfg, clips, cfg.data)
    windows = Windows(clips, device, cfg.seed)
    log({"phase": "data", "clips": len(clips), "seconds": time.perf_counter() - t_start})
    if vae is None:
        vae = train_vae(cfg, windows, device, log)
        vae = normalised(vae, *latent_stats(vae, windows))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"recipe": asdict(cfg), "device": gpu, "styles": list(STYLE_NAMES), "torch": torch.__version__}

    partial = out / "embedded.partial.safetensors"

    def save(dit: WanDiT, extra: dict) -> str:
        return save_embedded(partial, dit, vae, {**meta, "seconds": round(time.perf_counter() - t_start, 1), **extra})

    if cfg.decoder_steps:
        vae = tune_decoder(cfg, windows, vae, log)
    if not cfg.vae_from or cfg.decoder_steps:
        save(dit, {"phase": "vae"})  # a later run can start from this VAE (vae_from)
        if Path(cfg.eval_data).is_file():
            from loom_live.engine.train.evaluate import gate_summary, reconstruction

            rows = reconstruction(vae, load_pairs(cfg.eval_data)[1], device)
            log({"phase": "vae_gate", **gate_summary(rows), "rows": rows})
    dit = train_dit(cfg, windows, vae, dit, device, log, save)
    seconds = time.perf_counter() - t_start
    meta["seconds"] = round(seconds, 1)
    sha = save(dit, {})
    recipe = out / "recipe.json.partial"
    recipe.write_text(json.dumps({**meta, "sha256": sha}, indent=2))
    os.replace(partial, out / "embedded.safetensors")  # the weights and their recipe, together
    os.replace(recipe, out / "recipe.json")
    log({"phase": "done", "seconds": seconds, "sha256": sha})
    return out / "embedded.safetensors"
