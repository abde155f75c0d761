"""The Wan VAE's compiled steps, compiled in helper processes while the engine loads and compiles its DiT.

Why: on a cold compile cache a start compiles one graph after another in one process (torch's compiler
traces and lowers a graph at a time), and the VAE's whole encoder and decoder steps are the largest of
them. A helper process per direction builds the same VAE with random weights of the same layout (the
weights are the compiled code's inputs, not its constants), streams synthetic frames of the config's
size through the same steps the session's warm-up streams them through, and exits; Inductor's and
Triton's caches (one folder: engine/graphs/compile_cache.py) then hold those graphs. The engine's own
first compile of a step waits for the helpers and reads them from there, while everything before it
(loading, the DiT's graphs) ran beside the helpers. A config that has warmed up here before (a marker
beside the saved steps) starts no helper, so a warm start pays nothing.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

import numpy as np
import torch

from loom_live.engine.cache.vae_cache import FRAMES_PER_LATENT
from loom_live.engine.config import LoomConfig
from loom_live.engine.graphs.compile_cache import cache_root
from loom_live.engine.graphs.saved_compiles import compiled_folder, make_folder
from loom_live.engine.graphs.vae_steps import VAEGraphs
from loom_live.engine.models.loading import (
    LoadedModels,
    lay_out_wan_vae,
    resolve_device,
    resolve_dtype,
    seeded_wan_vae,
    use_cuda_compile_settings,
)
from loom_live.engine.models.wan_vae import WanVAE
from loom_live.engine.stream.frames import FrameMapper, vae_layout, vae_pixels
from loom_live.engine.stream.slo_scheduler import MAX_CHUNK_LATENTS
from loom_live.host_bridge.wire.params import FIRST_CHUNK_FRAMES

log = logging.getLogger(__name__)

WAIT_S = 600.0  # the longest an engine waits for a helper before compiling the step itself
MIN_FREE_GIB = 40.0  # free GPU memory at start for the engine's whole start-up beside two helpers' VAEs
STEADY_CHUNKS = 3  # steady chunks after the first: the decoder's histories reach their steady layout by then


class CompileAhead:
    """The helpers of one engine start: `attach` has each direction's first compile wait for them;
    `finish` reaps them and, after a warm-up, marks the config as compiled here."""

    def __init__(self, helpers: dict[str, BaseProcess], marker: Path) -> None:
        self.helpers, self.marker = helpers, marker
        self._waited: set[str] = set()

    @classmethod
    def start(cls, cfg: LoomConfig) -> CompileAhead | None:
        """Start a helper per direction the Wan VAE runs, or None where `vae.compile_ahead` is off, the
        session would not compile its VAE steps whole (a CPU, `vae.compile_step` off, steps kept under
        `saved_steps=none`), the stream is not one plain Wan stream (several GPUs, a control video, low
        VRAM's tiles), the GPU has no room for helpers beside the engine, or this config has warmed up here
        before."""
        vc = cfg.vae
        directions = [d for d, which in (("encode", vc.encoder), ("decode", vc.decoder)) if which == "wan"]
        if not (vc.compile_ahead and directions and vc.compile_step and vc.saved_steps != "none"):
            return None
        device = resolve_device(cfg.model.device)
        if device.type != "cuda" or cfg.parallel.gpus > 1 or cfg.vace or cfg.memory.low_vram:
            return None
        free = torch.cuda.mem_get_info(device)[0] / 2**30
        if free < MIN_FREE_GIB:  # helpers beside the engine could run it out of memory: it compiles alone
            log.info("compile ahead: not on this GPU (%.1f GiB free, %.0f wanted beside the engine's helpers)",
                     free, MIN_FREE_GIB)
            return None
        marker = _marker(cfg, device)
        if marker.is_file():
            return None
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state copied from this one
        helpers = {d: spawn.Process(target=compile_direction, args=(cfg, d), name=f"loom-compile-ahead-{d}")
                   for d in directions}
        try:
            for helper in helpers.values():
                helper.start()
        except OSError as exc:  # no process to spare: the engine compiles everything itself, as without helpers
            log.warning("compile ahead: cannot start its helpers (%s); compiling the VAE's steps here", exc)
            cls(helpers, marker).finish(warmed=False)
            return None
        log.info("compiling the VAE's steps ahead in %d helper processes (%s): this config has not warmed up "
                 "here yet", len(helpers), ", ".join(helpers))
        return cls(helpers, marker)

    def attach(self, models: LoadedModels) -> None:
        """Have the first compile of each direction's step wait for the helpers, its own first."""
        for direction, vae in (("encode", models.encoder), ("decode", models.decoder)):
            if isinstance(vae, WanVAE) and direction in self.helpers:
                vae.wait_before_compiling(direction, lambda d=direction: self._wait_all(d))

    def _wait_all(self, first: str) -> None:
        """Every helper, `first`'s first: the engine's first steady call of a step also times cuDNN's
        convolution algorithms (and, with `model.autotune_kernels`, Triton's block sizes) for the rest of
        its life, which another helper's work on the same GPU at that moment would skew. The other step is
        due within a chunk anyway."""
        for direction in sorted(self.helpers, key=lambda d: d != first):
            if direction not in self._waited:
                self._waited.add(direction)
                self._wait(direction)

    def _wait(self, direction: str) -> None:
        helper, t0 = self.helpers[direction], time.perf_counter()
        helper.join(WAIT_S)
        waited = time.perf_counter() - t0
        if helper.is_alive():
            helper.terminate()
            log.warning("compile ahead: the %s helper did not finish in %.0f s; compiling that step here", direction,
                        WAIT_S)
        elif helper.exitcode != 0:
            log.warning("compile ahead: the %s helper failed (exit code %s); compiling that step here", direction,
                        helper.exitcode)
        else:
            log.info("compile ahead: the %s step's helper done (waited %.1f s for it)", direction, waited)

    def finish(self, warmed: bool) -> None:
        """Stop any helper still running; after a warm-up (`warmed`), mark this config as compiled here."""
        for helper in self.helpers.values():
            if helper.pid is None:  # never started
                continue
            if helper.is_alive():
                helper.terminate()
            helper.join(10.0)
        if warmed:
            try:
                make_folder(self.marker.parent.parent)  # a new one prunes the oldest, as a saved step's would
                self.marker.parent.mkdir(exist_ok=True)
                self.marker.touch()
            except OSError as exc:  # a read-only cache folder: the next start compiles ahead again
                log.warning("compile ahead: cannot mark this config as compiled (%s)", exc)


def compile_direction(cfg: LoomConfig, direction: str) -> None:
    """A helper's whole life: the session's Wan VAE, laid out as the session lays it out, streaming one
    direction's chunks as the session's warm-up streams them (the same frame mapping, layouts and steps,
    so its graphs are the ones the engine will ask the caches for)."""
    logging.basicConfig(level=logging.WARNING)
    device = resolve_device(cfg.model.device)
    dtype = resolve_dtype(cfg.model.dtype, device)
    wan = seeded_wan_vae(cfg, device, dtype)
    wan.use_upsample(cfg.vae.upsample)
    if device.type == "cuda":  # as load_models does there (a CPU run: the tests' mirror of a CPU session)
        if device.index is not None:  # "cuda" alone: this fresh process's current GPU, the engine's own
            torch.cuda.set_device(device)
        use_cuda_compile_settings(cfg)
        lay_out_wan_vae(wan, cfg.vae, compiled_folder(cache_root(), device))
    wan.requires_grad_(False)
    graphs = VAEGraphs(cfg.stream.cuda_graphs)
    h, w = cfg.resolution.height, cfg.resolution.width
    mapper = FrameMapper(w, h, cfg.resolution.resize, device, dtype)
    rng = np.random.default_rng(0)

    def pixels(count: int) -> torch.Tensor:  # as StreamSession._encode makes them
        return vae_pixels(mapper.to_model(rng.integers(0, 256, (count, h, w, 3), np.uint8)), vae_layout(device))

    st = cfg.stream  # a stream per chunk size the scheduler may pick (a size's pieces are views of its chunk)
    sizes = range(1, 1 + (min(MAX_CHUNK_LATENTS, st.num_kv_cache - st.sink) if st.mode == "auto" else 1))
    with torch.inference_mode():
        first = wan.encode_stream(pixels(FIRST_CHUNK_FRAMES), wan.new_stream_state())  # the latents' sizes
        state = wan.new_stream_state()  # one, reset in place between streams, as the session keeps its own
        for k in sizes:
            state.reset()
            if direction == "encode":
                for count in [FIRST_CHUNK_FRAMES] + [FRAMES_PER_LATENT * k] * STEADY_CHUNKS:
                    graphs.run("encode", wan.encode_stream, pixels(count), state)
            else:
                for latents in [first.shape[2]] + [k] * STEADY_CHUNKS:  # as the DiT hands them on: contiguous
                    z = torch.randn((*first.shape[:2], latents, *first.shape[3:]), device=device, dtype=dtype)
                    graphs.run("decode", wan.decode_stream, z, state)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _marker(cfg: LoomConfig, device: torch.device) -> Path:
    """One file per VAE layout, frame size, dtype, graph and kernel-tuning setting, in the saved steps' folder
    (named after the engine's sources, torch and the GPU, so a changed engine compiles ahead again)."""
    key = repr((cfg.vae, cfg.resolution, cfg.model.dtype, cfg.stream.cuda_graphs, cfg.model.autotune_kernels))
    return compiled_folder(cache_root(), device) / "ahead" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.done"
