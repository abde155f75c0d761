"""One pipeline rank's share of the streaming DiT, and the loop of ranks 1..P-1.

A `Stage` holds a contiguous range of blocks, the KV cache of those blocks only (all n step
rows) and their cross-attention K/V. The range may be empty on rank 0 and the last rank (their
VAE work is a stage of its own, `engine/parallel/plan.py`): such a stage runs no block but still
plans every micro-batch on its (blockless) cache, passes the ring's messages on, applies live
settings and takes part in block moves, so a block can arrive there at any tick and find the
bookkeeping every other rank has. Every rank plans each micro-batch on its own cache with
the same (rows, frames, commit) in the same order, so the host-side bookkeeping (ring slots,
RoPE positions and refresh shifts, pending sink refreshes) evolves identically on every rank
without being exchanged; the device-side parts (ring re-rotation, adaptive sink replacement,
decided per block anyway) act on each rank's own blocks.

Message payload rank r -> r+1 (after a DATA header): tokens [B, f*h*w, dim], the rows' sigmas
[B] (float32), their noisy latents x_t [B, C, f, H, W] and the re-noise for their next step
[B, C, f, H, W] (the last rank needs both for the scheduler step), then the prompt embedding
[1, L, text_dim] when the header says NEW_CONTEXT. The last rank answers rank 0 with the rows'
next-step latents [B, C, f, H, W] and, when a chunk leaves, its decoded pixels [1, 3, T, H', W'].
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from loom_live.engine.cache.kv_cache import CrossKV, KVCache, StreamStep
from loom_live.engine.config import LoomConfig
from loom_live.engine.graphs.pipeline_blocks import GraphedBlocks
from loom_live.engine.graphs.vae_steps import VAEGraphs
from loom_live.engine.models.loading import LoadedModels, load_models
from loom_live.engine.models.wan_dit import Conditioning
from loom_live.engine.parallel.link import NEW_CONTEXT, REFRESH_SINKS, RESET, SCRUB, Header, Kind, Link
from loom_live.engine.stream.schedule import FlowSchedule
from loom_live.engine.stream.stage_timer import StageTimer

LATENT_STRIDE = 8  # VAE spatial compression: pixels per latent
INIT_TIMEOUT_S = 300  # rendezvous of the ranks (model loading is done before it)
BEAT_S = 0.1  # heartbeat period of a rank (rank 0 allows `parallel.rank_timeout_s` of silence)


@dataclass
class Payload:
    """The tensors of one micro-batch on its way through the ranks."""

    tokens: torch.Tensor
    sigmas: torch.Tensor
    latents: torch.Tensor
    noise: torch.Tensor
    context: torch.Tensor | None = None
    source: torch.Tensor | None = None  # the rows' clean latents, for a model that reads its input


def rank_device(cfg: LoomConfig, rank: int) -> torch.device:
    """Rank r's device: GPU (first + r) for a CUDA device setting, the CPU otherwise."""
    setting = cfg.model.device
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    first = int(setting.partition(":")[2] or 0)
    return torch.device("cuda", first + rank)


def rank_config(cfg: LoomConfig, rank: int) -> LoomConfig:
    return replace(cfg, model=replace(cfg.model, device=str(rank_device(cfg, rank))))


class Stage:
    """Blocks `blocks` of the DiT with their KV cache rows and cross K/V, on one rank."""

    def __init__(self, cfg: LoomConfig, models: LoadedModels, blocks: range) -> None:
        st = cfg.stream
        self.dit, self.blocks = models.dit, blocks
        self.device, self.dtype = models.device, models.dtype
        self.latent_hw = (cfg.resolution.height // LATENT_STRIDE, cfg.resolution.width // LATENT_STRIDE)
        self.cache = self.dit.new_cache(
            len(st.steps), self.latent_hw, num_kv_cache=st.num_kv_cache, sink=st.sink,
            rope_policy=st.rope_policy, refresh_at=st.rope_refresh_at, sink_threshold=st.sink_threshold,
            device=self.device, dtype=self.dtype, blocks=blocks)
        self.cross = None
        self.context: torch.Tensor | None = None  # the prompt embedding the cross K/V were made from
        self._graphs = st.cuda_graphs and self.device.type == "cuda"
        self._recapture()
        self.lora = models.lora
        self.timer = StageTimer(self.device)
        self.totals: dict[str, list[float]] = {}  # stage -> [calls, seconds]
        self.window: dict[str, float] = {}  # stage -> seconds since the scheduler last asked
        self.window_ticks = 0

    def _recapture(self) -> None:
        """Captured graphs hold the old cache's and blocks' tensors: capture afresh (no blocks: nothing to replay)."""
        self.graphed = GraphedBlocks(self._blocks) if self._graphs and self.blocks else None

    def change_steps(self, steps: int, nearest: list[int]) -> None:
        """A new step list (the ring is drained): row i takes the cache row of the nearest old step,
        as `StreamDenoiser.change_steps` does on one GPU."""
        self.cache = self.cache.rows(nearest)
        self._recapture()

    def set_sink_threshold(self, threshold: float) -> None:
        self.cache.set_sink_threshold(threshold)
        self._recapture()

    def set_lora_scales(self, scales: dict[str, float]) -> None:
        """Each rank merges the scales into its own blocks (the merger skips blocks it does not hold)."""
        rewritten = self.lora.set_scales(scales)
        if self.context is not None:  # cross-attention K/V depend on the merged weights too
            self.cross = self.dit.cross_kv_refreshed(self.cross, self.context, rewritten, blocks=self.blocks)

    # ----- moving a block to a neighbouring rank ------------------------------------------------
    def block_tensors(self, block: int) -> list[torch.Tensor]:
        """Everything a rank needs to run `block` from now on, in a fixed order both ends know:
        its parameters and buffers, then its K/V cache rows and its cross-attention K/V."""
        module = self.dit.blocks[block]
        return [*module.parameters(), *module.buffers(), self.cache.k[block], self.cache.v[block],
                self.cross.k[block], self.cross.v[block]]

    def give_block(self, block: int, link: Link, dst: int, forward: bool) -> None:
        """Send `block` (weights, caches) to rank `dst`, the next rank when `forward`, and drop it
        here; the rank may give its only block (rank 0, the last rank: `plan.check_move`)."""
        if block != (self.blocks.stop - 1 if forward else self.blocks.start) or not self.blocks:
            side, end = ("next", "last") if forward else ("previous", "first")
            raise ValueError(f"block {block}: a rank with blocks {list(self.blocks)} gives the {side} rank only "
                             f"its {end} block")
        self.lora.forget(f"blocks.{block}.")  # the original weights travel; the receiver merges its LoRAs
        for t in self.block_tensors(block):
            link.send(t, dst)
        self.cache.pop_block(block)
        self.cross.k.pop(block)
        self.cross.v.pop(block)
        self.dit.blocks[block].to("meta")
        start, stop = self.blocks.start, self.blocks.stop
        self.blocks = range(start, stop - 1) if forward else range(start + 1, stop)
        self._recapture()

    def take_block(self, block: int, link: Link, src: int, forward: bool) -> None:
        """Receive `block` from rank `src` (its `give_block`; `forward`: from the previous rank),
        then merge this rank's LoRAs into it. An empty range takes the block where it sits."""
        if block != (self.blocks.start - 1 if forward else self.blocks.stop):
            raise ValueError(f"block {block} does not border blocks {list(self.blocks)} from the "
                             f"{'previous' if forward else 'next'} rank")
        module = self.dit.blocks[block]
        module.to_empty(device=self.device)
        for t in [*module.parameters(), *module.buffers()]:
            t.copy_(link.recv(tuple(t.shape), t.dtype, src))
        k, v = (link.recv(self.cache.block_shape, self.dtype, src) for _ in range(2))
        self.cache.put_block(block, k, v)
        cross = self.cross_shape()
        self.cross.k[block], self.cross.v[block] = (link.recv(cross, self.dtype, src) for _ in range(2))
        self.lora.adopt(f"blocks.{block}.")
        start, stop = self.blocks.start, self.blocks.stop
        self.blocks = range(start - 1, stop) if forward else range(start, stop + 1)
        self._recapture()

    def cross_shape(self) -> tuple[int, ...]:
        """The shape of one block's cross-attention K (and V) for the current prompt embedding."""
        cfg = self.dit.cfg
        return (self.context.shape[0], cfg.text_len, cfg.num_heads, cfg.head_dim)

    def apply(self, flags: int, context: torch.Tensor | None) -> None:
        """Header flags, in the order the one-GPU session applies them before a forward."""
        if flags & RESET:
            self.cache.reset()
        if flags & SCRUB:
            self.cache.scrub()
        if flags & NEW_CONTEXT:
            self.context = context
            self.cross = self.dit.cross_kv(context, blocks=self.blocks)
        if flags & REFRESH_SINKS:
            self.cache.refresh_sinks()

    def condition(self, sigmas: torch.Tensor, frames: int) -> Conditioning:
        return self.dit.condition(self.timesteps(sigmas), frames)

    def timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """The timesteps the DiT is conditioned on, exactly as `StreamDenoiser._forward` makes them."""
        return (sigmas * FlowSchedule.train_timesteps).to(self.dtype)

    def run(self, tokens: torch.Tensor, cond: Conditioning, first_step: int, frames: int) -> torch.Tensor:
        """This rank's blocks on rows [first_step, first_step + B) of its cache, committing the chunk."""
        rows = list(range(first_step, first_step + tokens.shape[0]))
        view = self.cache.rows(slice(rows[0], rows[-1] + 1))
        step = view.plan(frames, True)
        full = len(rows) == self.cache.batch  # steady state: every step row (fill and drain run eagerly)
        run = self.graphed if self.graphed is not None and full else self._blocks
        tokens = run(tokens, cond.mod, self.cross, view, step)
        view.finish(step)
        self.cache.set_rows(rows, view)
        return tokens

    def _blocks(self, tokens: torch.Tensor, mod: torch.Tensor, cross: CrossKV, cache: KVCache,
                step: StreamStep) -> torch.Tensor:
        return self.dit.run_blocks(self.blocks.start, self.blocks.stop, tokens, Conditioning(temb=None, mod=mod),
                                   cross, cache.attention(step, self.dit.ops.cache))

    def collect(self) -> None:
        for name, _, seconds in self.timer.collect():
            rec = self.totals.setdefault(name, [0, 0.0])
            rec[0] += 1
            rec[1] += seconds
            self.window[name] = self.window.get(name, 0.0) + seconds

    def take_window(self, rank: int) -> dict[str, Any]:
        """Stage seconds since the last call (for the block scheduler), then a new window."""
        self.collect()
        out = {"rank": rank, "blocks": [self.blocks.start, self.blocks.stop], "ticks": self.window_ticks,
               "seconds": dict(self.window)}
        self.window.clear()
        self.window_ticks = 0
        return out

    def report(self, rank: int, wait_s: float) -> dict[str, Any]:
        self.collect()
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        return {"rank": rank, "blocks": [self.blocks.start, self.blocks.stop], "device": str(self.device),
                "wait_s": wait_s, "gpu_memory_peak_bytes": peak,
                "stages_ms": {k: {"mean": 1000.0 * s / n, "count": n} for k, (n, s) in self.totals.items()}}


def token_shape(stage: Stage, header: Header) -> tuple[int, ...]:
    _, ph, pw = stage.dit.cfg.patch_size
    h, w = stage.latent_hw
    return (header.rows, header.frames * (h // ph) * (w // pw), stage.dit.cfg.dim)


def latent_shape(stage: Stage, header: Header) -> tuple[int, ...]:
    return (header.rows, stage.dit.cfg.in_channels, header.frames, *stage.latent_hw)


def send_payload(link: Link, dst: int, p: Payload) -> None:
    for t in (p.tokens, p.sigmas, p.latents, p.noise):
        link.send(t, dst)
    if p.source is not None:
        link.send(p.source, dst)
    if p.context is not None:
        link.send(p.context, dst)


def recv_payload(link: Link, src: int, stage: Stage, header: Header) -> Payload:
    lat = latent_shape(stage, header)
    p = Payload(link.recv(token_shape(stage, header), stage.dtype, src),
                link.recv((header.rows,), torch.float32, src),
                link.recv(lat, stage.dtype, src), link.recv(lat, stage.dtype, src))
    cfg = stage.dit.cfg
    if cfg.source_channels:  # the head on the last rank reads them
        p.source = link.recv((lat[0], cfg.source_channels, *lat[2:]), stage.dtype, src)
    if header.flags & NEW_CONTEXT:
        p.context = link.recv((1, header.context_len, stage.dit.cfg.text_dim), stage.dtype, src)
    return p


class LastRank:
    """The last rank's extra work: head, scheduler step (x0, re-noise) and the VAE decode."""

    def __init__(self, cfg: LoomConfig, models: LoadedModels, stage: Stage) -> None:
        self.stage, self.models = stage, models
        self.schedule = FlowSchedule(shift=cfg.stream.timestep_shift)
        self.sigmas = [self.schedule.sigma(s) for s in cfg.stream.steps]
        self.dec_state = models.decoder.new_stream_state()
        self.graphs = VAEGraphs(cfg.stream.cuda_graphs and stage.device.type == "cuda" and not cfg.memory.low_vram)

    def finish(self, header: Header, p: Payload, tokens: torch.Tensor, cond: Conditioning
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Head and scheduler step; returns (next-step latents per row, decoded pixels or None)."""
        s, n = self.stage, len(self.sigmas)
        if header.flags & RESET:
            self.dec_state.reset()
        with s.timer.span("head"):
            h, w = s.latent_hw
            _, ph, pw = s.dit.cfg.patch_size
            flow = s.dit.head(tokens, cond, (header.frames, h // ph, w // pw), p.latents, p.sigmas, p.source)
            x0 = self.schedule.to_x0(p.latents.float(), flow.float(), p.sigmas.float()).to(p.latents.dtype)
            nxt = x0.clone()
            for j in range(header.rows):
                step = header.first_step + j
                if step < n - 1:
                    nxt[j:j + 1] = self.schedule.add_noise(x0[j:j + 1], p.noise[j:j + 1], self.sigmas[step + 1])
        pixels = None
        if header.first_step + header.rows == n:  # the last row has had its last step: it leaves
            with s.timer.span("decode"):
                pixels = self.graphs.run("decode", self.models.decoder.decode_stream, x0[-1:], self.dec_state)
        return nxt, pixels


def configure(stage: Stage, last: LastRank | None, extra: dict[str, Any]) -> None:
    """Live settings, applied between the same two micro-batches on every rank."""
    if "steps" in extra:
        stage.change_steps(len(extra["steps"]), extra["nearest"])
        if last is not None:
            last.sigmas = [last.schedule.sigma(s) for s in extra["steps"]]
    if "sink_threshold" in extra:
        stage.set_sink_threshold(extra["sink_threshold"])
    if "lora_scales" in extra:
        stage.set_lora_scales(extra["lora_scales"])


def move(stage: Stage, rank: int, link: Link, extra: dict[str, Any]) -> None:
    """This rank's part of a block move (see `Kind.MOVE`); ranks not involved do nothing."""
    forward = extra["dst"] > extra["src"]
    if rank == extra["src"]:
        stage.give_block(extra["block"], link, extra["dst"], forward)
    elif rank == extra["dst"]:
        stage.take_block(extra["block"], link, extra["src"], forward)
    stage.take_window(rank)  # the scheduler's next window measures the new split only


def beat(beats: Any, rank: int) -> None:
    """The heartbeat of a rank: rank 0 takes a stale one for a hung process (stopped, frozen)."""
    while True:
        beats[rank] = time.monotonic()
        time.sleep(BEAT_S)


def serve(rank: int, world: int, cfg: LoomConfig, blocks: range, inbox: Connection, outbox: Connection,
          events: Any, init_file: str, parent_pid: int) -> None:
    """The loop of a rank > 0: receive a micro-batch, run the blocks, pass it on (or finish it)."""

    def parent_alive() -> None:
        if os.getppid() != parent_pid:
            raise SystemExit(f"pipeline rank {rank}: the engine process (pid {parent_pid}) is gone")

    device = rank_device(cfg, rank)  # from the engine's config: a rank_config already has the offset in it
    if device.type == "cuda":
        torch.cuda.set_device(device)
    own = rank_config(cfg, rank)
    models = load_models(own, dit_blocks=blocks)
    stage = Stage(own, models, blocks)
    last = LastRank(own, models, stage) if rank == world - 1 else None
    events.put(("loaded", rank, None))
    link = Link(device, init_group(cfg, rank, world, init_file))
    wait_s = 0.0
    with torch.inference_mode():
        while True:
            t = time.perf_counter()
            header = link.recv_header(inbox, parent_alive)
            wait_s += time.perf_counter() - t
            if header.kind == Kind.STOP:
                if last is None:
                    link.send_header(outbox, header)
                break
            if header.kind == Kind.STATS:
                report = stage.report(rank, wait_s)
                events.put(("stats", rank, report))
                if header.extra.get("reset"):
                    stage.totals.clear()
                    wait_s = 0.0
                if last is None:
                    link.send_header(outbox, header)
                continue
            if header.kind in (Kind.CONFIG, Kind.MOVE, Kind.TIMES):
                if last is None:  # passed on first: a block coming back from the next rank needs it there
                    link.send_header(outbox, header)
                if header.kind == Kind.CONFIG:
                    configure(stage, last, header.extra)
                elif header.kind == Kind.MOVE:
                    move(stage, rank, link, header.extra)
                else:
                    events.put(("times", rank, stage.take_window(rank)))
                continue
            p = recv_payload(link, rank - 1, stage, header)
            stage.apply(header.flags, p.context)
            cond = stage.condition(p.sigmas, header.frames)
            with stage.timer.span("dit"):
                p.tokens = stage.run(p.tokens, cond, header.first_step, header.frames)
            if last is None:
                link.send_header(outbox, header)
                send_payload(link, rank + 1, p)
            else:
                nxt, pixels = last.finish(header, p, p.tokens, cond)
                out = replace(header, context_len=0, flags=0, out_frames=0 if pixels is None else pixels.shape[2])
                link.send_header(outbox, out)
                link.send(nxt, 0, back=True)
                if pixels is not None:
                    link.send(pixels, 0, back=True)
            stage.window_ticks += 1
            stage.collect()
        link.flush()


def init_group(cfg: LoomConfig, rank: int, world: int, init_file: str) -> dist.ProcessGroup:
    """Join the ranks' process group (NCCL between GPUs, gloo between CPU processes); returns the
    group of the return path, rank P-1 -> rank 0 (see engine/parallel/link.py)."""
    device = rank_device(cfg, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S), **kwargs)
    return dist.new_group([0, world - 1])


def worker_main(rank: int, world: int, cfg: LoomConfig, blocks: range, inbox: Connection, outbox: Connection,
                events: Any, init_file: str, parent_pid: int, beats: Any) -> None:
    """Entry point of a spawned rank: any failure is reported to rank 0 with its traceback."""
    threading.Thread(target=beat, args=(beats, rank), name=f"loom-rank{rank}-heartbeat", daemon=True).start()
    if rank_device(cfg, rank).type == "cpu":
        torch.set_num_threads(1)  # CPU ranks share the machine's cores
    try:
        serve(rank, world, cfg, blocks, inbox, outbox, events, init_file, parent_pid)
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
