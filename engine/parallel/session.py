"""Pipeline parallelism of the streaming DiT over several GPUs: `PipelineSession` (rank 0).

A user only says how many GPUs (`parallel.gpus = P`); this process becomes rank 0 and spawns
ranks 1..P-1 (torch.multiprocessing), which join one torch.distributed group (NCCL on GPUs,
gloo on CPUs). The DiT's blocks are cut into P contiguous ranges, the placement
(`engine/parallel/plan.py`):
- rank 0: frames in, preprocess, motion-aware noise, VAE encode, the noise of every step
  (see below), patch and time embedding, its blocks; frames out (postprocess);
- ranks 1..P-2: their blocks (at least one);
- rank P-1: its blocks, the head, the scheduler step (x0, re-noise) and the VAE decode.
Rank 0 and rank P-1 may hold no block: their VAE work is then a stage of its own, which is the
fastest placement when the VAE outweighs the DiT. Each rank loads only its blocks' weights and
holds only their KV cache (all n step rows) and cross-attention K/V. Activations [B, tokens,
dim] go rank to rank (`engine/parallel/link.py`); a rank without blocks passes them on as they
came (rank 0: the embedded tokens).

How the stream-batch rows go round the ring. With n steps a chunk passes the ring n times; row
i of the KV cache only ever sees chunks at step i, as on one GPU. The unit on the ring is a
tick's micro-batch: at tick t rank 0 sends the rows {chunk t at step 0} plus every row that
came back from tick t-P, now one step further. By induction tick t holds chunk t - i*P at step i
(i = 0..n-1): n rows, one chunk enters and one leaves per tick, and P ticks are in flight, so
every rank works on a different tick at the same time. Rank 0 waits for tick t-P's return
before sending tick t; that return (rank P-1 -> rank 0) carries the rows' next-step latents,
and the decoded pixels of the chunk that had its last step. With 1 step nothing comes back but
the pixels: only each rank's own KV cache orders successive chunks. The first chunk (5 frames,
2 latent frames) cannot share a forward with 1-latent chunks: a tick is sent as one message per
run of rows of equal length. Pushes drive the ring as they drive the one-GPU session: chunk c
comes out of the push of chunk c + n*P (one GPU: chunk c + n - 1), and `flush` drains the ring.

Plans, as on one GPU (`engine/stream/slo_scheduler.py`): stream-batch as above, or sequential,
where the ring is drained and each chunk then goes round it n times alone and leaves within its
own push (the lowest latency, one rank busy at a time); and chunks of 1 to `MAX_CHUNK_LATENTS`
latent frames (rows of another length travel as messages of their own). `stream.mode` pins the
mode (a live parameter); in auto mode the SLO scheduler prices every plan from the stage times
the ranks report every `SLO_WINDOW_CHUNKS` chunks (`engine/parallel/slo.py`) and switches with
the one-GPU margin and patience. Across every switch the noise is drawn in the one-GPU order:
the ledger drains its rows where one GPU drains its denoiser (a sequential chunk, a new size).

Same function as one GPU: every row sees the same chunks in the same order with the same
conditioning, and rank 0 replays the one-GPU noise draws (`NoiseLedger`), so outputs match the
single-process session to float tolerance (tests/integration/test_pipeline_*.py). One difference: a
prompt change reaches each row at the tick it is applied on, which groups rows differently
from one GPU's forwards, so a blend is applied a few chunks apart between the two.

Each rank replays CUDA graphs of its blocks for full micro-batches (engine/graphs/pipeline_blocks.py).

Live control travels the ring in stream order, as headers between two ticks, so every rank
applies it between the same two micro-batches: a step change drains the ring first (as one GPU
drains its denoiser) and then maps each rank's cache rows to the new steps; the sink threshold
and LoRA scales apply on each rank to its own blocks. A block moves the same way (`move_block`):
the giving rank sends its weights, KV cache rows and cross-attention K/V after the last tick it
ran the block for, and the receiving rank runs it from the next tick on, so the frames are those
of no move; a move may take the last block off rank 0 or the last rank, or bring one to them
again. The block scheduler (`engine/parallel/scheduler.py`) decides the moves from stage times
measured continuously on every rank; the VAE encode (rank 0) and decode (the last rank) are
measured as stages of their own and weigh in as the fixed work of those ranks.

Failures: a rank that fails reports its traceback, one that exits is seen by its exit code, one
that hangs (stopped, frozen) by its heartbeat going stale for `parallel.rank_timeout_s`; any of
them ends the session with a `PipelineError` naming the rank, and the server then exits so the
host's supervisor starts a fresh engine. Limits: the SLO scheduler learns from windows of
several chunks, not from each chunk, so it switches a few chunks later than one GPU would, and
the same script of plans gives the one-GPU frames only when it switches at the same chunks; no
side-stream encode overlap as on one GPU; one node only.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loom_live.engine.cache.vae_cache import FRAMES_PER_LATENT
from loom_live.engine.config import LoomConfig
from loom_live.engine.graphs.vae_steps import VAEGraphs
from loom_live.engine.models.dit_source import dit_source
from loom_live.engine.models.loading import load_models, resolve_device
from loom_live.engine.models.wan_dit import DIT_PRESETS
from loom_live.engine.parallel.link import NEW_CONTEXT, REFRESH_SINKS, RESET, SCRUB, Header, Kind, Link
from loom_live.engine.parallel.plan import NoiseLedger, check_move, check_split, placement, stage_ranges, suggest_split
from loom_live.engine.parallel.ranks import PipelineError, RankProcesses
from loom_live.engine.parallel.scheduler import BlockScheduler
from loom_live.engine.parallel.slo import PipelineSLO
from loom_live.engine.parallel.stage import (
    Payload,
    Stage,
    configure,
    init_group,
    move,
    rank_config,
    rank_device,
    send_payload,
)
from loom_live.engine.startup_progress import STARTUP_PROGRESS
from loom_live.engine.stream.frames import FrameMapper, vae_layout, vae_pixels, validate_frames
from loom_live.engine.stream.metrics import StreamMetrics
from loom_live.engine.stream.motion_noise import MotionNoiseController
from loom_live.engine.stream.no_vace import NoStructureControl
from loom_live.engine.stream.nonfinite_watch import watch_for
from loom_live.engine.stream.prompts import PromptConditioner, check_prompt, make_text_encoder
from loom_live.engine.stream.schedule import FlowSchedule
from loom_live.engine.stream.session import edge_control
from loom_live.engine.stream.slo_scheduler import MAX_CHUNK_LATENTS, Plan, allowed_modes
from loom_live.engine.stream.warmup_pace import WarmupPace
from loom_live.host_bridge.wire.params import FIRST_CHUNK_FRAMES

STOP_JOIN_S = 20.0  # a clean stop: ranks finish what is in flight and exit
# Heartbeat allowance on GPUs before the warm-up ends: compiling a kernel can hold a rank's GIL
# (and so its heartbeat thread) for seconds
SETTLING_TIMEOUT_S = 120.0
SLO_WINDOW_CHUNKS = 8  # in auto mode, the ranks' stage times are asked for every this many chunks

__all__ = ["PipelineError", "PipelineSession", "check_pipeline"]

log = logging.getLogger(__name__)


def check_pipeline(cfg: LoomConfig) -> list[int]:
    """The split of `cfg`'s pipeline, checked against its model's blocks and the GPUs here; ValueError naming
    the setting and what is allowed. It starts nothing, so `loom serve` calls it before it serves: a pipeline
    that cannot run is refused at once, not when the first host connects."""
    split = check_split(cfg.parallel.split, DIT_PRESETS[cfg.model.preset].num_layers, cfg.parallel.gpus)
    resolve_device(cfg.model.device)  # a CUDA setting without CUDA is said as such, not as 0 GPUs visible
    first = rank_device(cfg, 0)
    if first.type == "cuda":
        visible, last = torch.cuda.device_count(), rank_device(cfg, cfg.parallel.gpus - 1).index
        if last >= visible:
            raise ValueError(f"parallel.gpus: {cfg.parallel.gpus} GPUs from {first} on need GPU {last}, but only "
                             f"{visible} are visible; allowed: at most {max(visible - (first.index or 0), 0)}")
    return split


@dataclass
class _Row:
    chunk: int
    step: int
    latent: torch.Tensor  # [1, C, f, H, W] noisy at its step
    sigma: torch.Tensor | float


@dataclass
class _Chunk:
    frames: np.ndarray | torch.Tensor  # the accepted input frames (for the crop policy's border)
    first: bool
    source: torch.Tensor | None = None  # its clean latents, for a model that reads its input (every step)


class PipelineSession:
    """A live stream with the DiT split over `cfg.parallel.gpus` ranks. Drive it from one thread.

    It implements `engine.session_api.EngineSession`, as `StreamSession` does.
    """

    raw_passthrough = False

    @property
    def accepts_device_frames(self) -> bool:
        """On GPUs rank 0 takes device tensors (the cuda-ipc server's frames) and answers with
        tensors on its device; numpy frames are answered with numpy frames."""
        return self.device.type == "cuda"

    @classmethod
    def from_config(cls, cfg: LoomConfig, warmup: bool = True, warmup_share: float = 1.0) -> PipelineSession:
        """Build and, on GPUs, warm up (compilation and graph capture happen before the first frame), paced by
        `warmup_share` below 1."""
        STARTUP_PROGRESS.say(f"loading the model on {cfg.parallel.gpus} GPUs")
        session = cls(cfg)
        if warmup and session.device.type == "cuda":
            session.warmup(share=warmup_share)
        return session

    @property
    def unfinished(self) -> int:
        """Chunks finished but not yet handed out (a step change drains the ring between pushes)."""
        return len(self._outputs)

    def __init__(self, cfg: LoomConfig) -> None:
        self.no_control = NoStructureControl("the pipelined Wan DiT (parallel.gpus > 1)")
        self.cfg, self.P = cfg, cfg.parallel.gpus
        if self.P < 2:
            raise ValueError(f"parallel.gpus: {self.P}; the pipeline needs 2 or more (1 GPU: StreamSession)")
        self.split = check_pipeline(cfg)
        self.ranges = stage_ranges(self.split)
        self.device = rank_device(cfg, 0)
        self.n = len(cfg.stream.steps)
        self._closed = False
        self._waiting: Callable[[], None] | None = None  # the caller's work while rank 0 waits (while_waiting)
        self.ranks = RankProcesses(cfg, self.ranges)
        if self.device.type == "cuda":  # until warmed up, a rank may sit in a compiler holding the GIL
            self.ranks.timeout_s = max(SETTLING_TIMEOUT_S, cfg.parallel.rank_timeout_s)
        try:
            self._start()
        except BaseException:
            self._closed = True
            self.ranks.kill()
            raise

    # ----------------------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        cfg0 = rank_config(self.cfg, 0)
        self.models = load_models(cfg0, dit_blocks=self.ranges[0])  # while the other ranks load theirs
        self.ranks.await_events("loaded", self.P - 1)
        self.link = Link(self.device, init_group(cfg0, 0, self.P, self.ranks.init_file))
        self.dtype = self.models.dtype
        self.stage = Stage(cfg0, self.models, self.ranges[0])
        self.schedule = FlowSchedule(shift=self.cfg.stream.timestep_shift)
        self.sigmas = [self.schedule.sigma(s) for s in self.cfg.stream.steps]
        self.mapper = FrameMapper(self.cfg.resolution.width, self.cfg.resolution.height,
                                  self.cfg.resolution.resize, self.device, self.dtype)
        pc = self.cfg.prompt
        on_gpu = self.device.type == "cuda" and (pc.device == "cuda" or pc.device == "auto"
                                                  and not self.cfg.memory.low_vram)
        dit = self.models.dit.cfg
        encoder = make_text_encoder(pc.encoder, dit.text_dim, pc.path, "cuda" if on_gpu else "cpu", dit.text_len)
        self.prompt = PromptConditioner(encoder, pc.text, device=self.device, dtype=self.dtype,
                                        transition_chunks=pc.transition_chunks, blend_mode=pc.blend)
        nc = self.cfg.noise
        self.motion = MotionNoiseController(nc.noise_scale, nc.ema, nc.motion_aware, nc.estimator)
        self.enc_state = self.models.encoder.new_stream_state()
        self._vae_graphs = VAEGraphs(self.cfg.stream.cuda_graphs and self.device.type == "cuda")
        self._vae_watch = watch_for(self.models, self.device)  # on the frames the last rank sends back
        self.vae_restarts = 0  # new streams started because the float16 VAE made NaN
        self.metrics = StreamMetrics(self.cfg.slo.latency_budget_ms / 1000.0)
        st, modes = self.cfg.stream, allowed_modes(self.cfg.stream.mode)
        self.slo = PipelineSLO(self.P, self.n, target_fps=self.cfg.slo.target_fps,
                               latency_budget_s=self.cfg.slo.latency_budget_ms / 1000.0,
                               initial=Plan(modes[0], 1), allowed_modes=modes,
                               max_chunk_latents=1 if self.cfg.memory.low_vram
                               else min(MAX_CHUNK_LATENTS, st.num_kv_cache - st.sink))
        self._work: dict[str, list[float]] = {}  # what rank 0 sent since the ranks last reported times
        self._slo_chunks = 0
        self._next_chunk = 0
        self._tick = 0
        self._wait_s = 0.0
        self._chunks_done = 0
        self.ledger = NoiseLedger(self.n, self._generator(), self.device, self.dtype)
        pc = self.cfg.parallel
        self.scheduler = BlockScheduler(pc.rebalance_threshold, pc.rebalance_dwell_chunks) if pc.rebalance else None
        self._times: list[dict[str, Any]] | None = None  # the windows of a scheduler round being collected
        self._times_work: dict[str, list[float]] = {}  # the work those windows cover
        self.moves = 0
        self._new_stream()

    def _generator(self) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(self.cfg.stream.seed)

    @torch.inference_mode()
    def _new_stream(self, scrub: bool = False) -> None:
        """Start a new stream (after a flush): caches, positions, noise; metrics and prompt stay. `scrub`: the
        old stream made NaN, which a reset would leave in the KV caches' masked slots (every rank's)."""
        self.ledger.reset(self._generator())
        self.motion.reset()
        self.stage.cache.reset()
        if scrub:
            self.stage.cache.scrub()
        self.enc_state.reset()
        self._buffer: list[np.ndarray | torch.Tensor] = []
        self._frame_shape: tuple[int, ...] | None = None  # the input size of the frames in the ring
        self._chunks: dict[int, _Chunk] = {}
        self._inflight: deque[list[Header]] = deque()
        self._received: deque[list[_Row]] = deque()  # returns collected ahead of their tick (a block move)
        self._outputs: list[np.ndarray | torch.Tensor] = []
        self._prev_last: torch.Tensor | None = None
        self._prev_last_u8: np.ndarray | torch.Tensor | None = None
        self._stream_chunks = 0
        self._flags = RESET | NEW_CONTEXT | (SCRUB if scrub else 0)  # the other ranks, with the next micro-batch
        self._context = self.prompt.current()[None]

    def close(self) -> None:
        """Stop every rank (they finish what is in flight) and leave no process behind."""
        if not self._closed and self.ranks.alive:
            try:
                with torch.inference_mode():
                    while self._inflight:
                        self._receive(self._inflight.popleft(), keep=False)
                self.link.send_header(self.ranks.outbox, Header(Kind.STOP))
                self.link.flush()
                self.ranks.join(STOP_JOIN_S)
            except Exception:  # noqa: BLE001 - closing must not fail half-way: the ranks are killed below
                pass
        self._shut()
        self.prompt.close()
        self.motion.close()

    def _shut(self) -> None:
        if not self._closed:
            self._closed = True
            self.ranks.kill()

    def __enter__(self) -> PipelineSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def warmup(self, chunks: int | None = None, share: float = 1.0) -> None:
        """Stream synthetic frames through every rank (compilation, autotuning), then start afresh.

        The default runs past a RoPE refresh, so the step patterns of a long stream are met here. `share`
        below 1 rests after each push so the warm-up takes that share of the time (a standby beside a show)."""
        st = self.cfg.stream
        if chunks is None:
            chunks = (st.rope_refresh_at if st.rope_policy == "refresh" else 2 * st.num_kv_cache) + self.n * self.P + 2
        STARTUP_PROGRESS.say(f"compiling and warming up on every GPU ({chunks} chunks)")
        h, w = self.cfg.resolution.height, self.cfg.resolution.width
        frames = np.random.default_rng(0).integers(0, 256, (1 + FRAMES_PER_LATENT * chunks, h, w, 3), np.uint8)
        pace = WarmupPace(share, self.device)
        for start in range(0, len(frames), FRAMES_PER_LATENT * 8):
            self.push(frames[start:start + FRAMES_PER_LATENT * 8])
            pace.chunk_done()
        self.flush()
        self.stats(reset=True)
        self.slo.reset()  # compiling and capturing are not the stage times of the stream
        self.ranks.timeout_s = self.cfg.parallel.rank_timeout_s  # compiled and captured: silence means hung

    # ----------------------------------------------------------------------------- failures
    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Any failure inside the ring closes the session with the rank's error."""
        if self._closed:
            raise PipelineError("the pipeline session is closed")
        try:
            yield
        except PipelineError:
            self._shut()
            raise
        except Exception as exc:
            try:
                self.ranks.check()
            except PipelineError as rank_error:
                self._shut()
                raise rank_error from exc
            self._shut()
            raise

    def reset(self) -> None:
        """Start a new stream: what is in the ring is finished and dropped, metrics start afresh."""
        self.flush()
        self.metrics.reset()
        self.slo.reset()

    # ----------------------------------------------------------------------------- streaming
    def set_prompt(self, text: str, transition_chunks: int | None = None) -> None:
        self.prompt.request(check_prompt(text), transition_chunks)

    def set_reference(self, image: Any) -> None:
        self.no_control.reference(image)

    def set_params(self, **params: Any) -> None:
        """Change live parameters, as on one GPU; unknown keys or bad values raise ValueError naming
        them. Steps, sink threshold and LoRA scales reach every rank between the same two
        micro-batches; `mode` and the SLO targets go to the SLO scheduler, whose plan the next
        chunk follows (a switch to sequential drains the ring first, as one GPU drains its denoiser)."""
        new = self.cfg.with_live(params)
        old, self.cfg = self.cfg, new
        self.motion.set_noise(new.noise.noise_scale, new.noise.motion_aware)
        self.prompt.set_transition_chunks(new.prompt.transition_chunks)
        self.metrics.set_budget(new.slo.latency_budget_ms / 1000.0)
        self.slo.set_targets(new.slo.target_fps, new.slo.latency_budget_ms / 1000.0)
        if new.stream.mode != old.stream.mode:
            self.slo.allow_modes(allowed_modes(new.stream.mode))
        extra: dict[str, Any] = {}
        if new.stream.sink_threshold != old.stream.sink_threshold:
            extra["sink_threshold"] = new.stream.sink_threshold
        scales = {e.key: e.scale for e in new.lora if self.models.lora.scales.get(e.key) != e.scale}
        if scales:
            extra["lora_scales"] = scales
        with self._guard(), torch.inference_mode():
            if new.stream.steps != old.stream.steps:
                self._change_steps(list(old.stream.steps), list(new.stream.steps))
            if extra:
                self.link.send_header(self.ranks.outbox, Header(Kind.CONFIG, extra=extra))
                configure(self.stage, None, extra)

    def _change_steps(self, old: list[int], steps: list[int]) -> None:
        """New step list: the chunks in the ring leave (decoded as usual), then every rank maps its
        cache rows to the new steps (the nearest old step's row), as one GPU does."""
        self._drain()
        nearest = [min(range(len(old)), key=lambda i: abs(old[i] - s)) for s in steps]
        self.link.send_header(self.ranks.outbox, Header(Kind.CONFIG, extra={"steps": steps, "nearest": nearest}))
        self.stage.change_steps(len(steps), nearest)
        self.n = len(steps)
        self.slo.set_steps(self.n)
        self.sigmas = [self.schedule.sigma(s) for s in steps]
        self.ledger = NoiseLedger(self.n, self.ledger.generator, self.device, self.dtype)  # the same draws go on

    def _drain(self) -> None:
        """Finish every row in the ring, drawing the re-noise in the one-GPU drain's order."""
        self.ledger.drain()
        while any(self._inflight) or any(self._received):
            self._send_tick(None)
        self._inflight.clear()  # ticks that carried nothing: the ring is empty

    # ----------------------------------------------------------------------------- block moves
    def move_block(self, block: int, dst: int) -> None:
        """Move `block` (an end block of its rank) to the neighbouring rank `dst`, with its weights,
        KV cache rows and cross-attention K/V, between two ticks and without draining the ring:
        the move travels the ring in stream order, so every tick runs each block exactly once. A
        block moving to rank 0 arrives only after rank 1 ran the ticks in flight, so rank 0 collects
        their returns first: the ring runs without overlap for one round then."""
        src = check_move(self.split, block, dst)
        with self._guard(), torch.inference_mode():
            if dst == 0:  # the block comes from rank 1 once it ran every tick before the move: collect them first
                while self._inflight:
                    self._received.append(self._receive(self._inflight.popleft()))
            self.link.send_header(self.ranks.outbox, Header(Kind.MOVE, extra={"block": block, "src": src,
                                                                              "dst": dst}))
            self._collect_timings()
            move(self.stage, 0, self.link, {"block": block, "src": src, "dst": dst})
            self._work = {}  # every rank's window starts afresh (`move`)
        self.split[src] -= 1
        self.split[dst] += 1
        self.ranges = stage_ranges(self.split)
        self.moves += 1
        log.info("pipeline: block %d moved from rank %d to rank %d; split %s: %s", block, src, dst, self.split,
                 " | ".join(map(str, placement(self.split))))

    def _schedule(self) -> None:
        """After a chunk: when the block scheduler is due, or every few chunks in auto mode, ask
        the ranks for the stage times of the window since the last ask; once all have answered,
        the SLO scheduler learns from them and the block scheduler moves a block when it pays."""
        if self._times is None:
            slo_due = self.cfg.stream.mode == "auto" and self._slo_chunks >= SLO_WINDOW_CHUNKS
            if slo_due or (self.scheduler is not None and self.scheduler.due()):
                self._collect_timings()
                self._times = [self.stage.take_window(0)]
                self._times_work, self._work, self._slo_chunks = self._work, {}, 0
                self.link.send_header(self.ranks.outbox, Header(Kind.TIMES))
            return
        self.ranks.check()
        self._times += self.ranks.take_events("times")
        if len(self._times) < self.P:
            return
        windows, self._times = sorted(self._times, key=lambda w: w["rank"]), None
        self.slo.observe_windows(windows, self._times_work)
        decision = self.scheduler.decide(windows, self.split) if self.scheduler is not None and \
            self.scheduler.due() else None
        if decision is not None:
            self.move_block(*decision)
            self.scheduler.moved()

    def _count(self, kind: str, units: int) -> None:
        """Work sent to the ranks, for the SLO scheduler (see `PipelineSLO.observe_windows`)."""
        rec = self._work.setdefault(kind, [0, 0])
        rec[0] += units
        rec[1] += 1

    def push(self, frames: np.ndarray | torch.Tensor, control: Any = None) -> np.ndarray | torch.Tensor:
        """Feed uint8 RGB frames [N, H, W, 3]; returns the restyled frames that became ready.
        Bad frames raise ValueError and leave the stream as it was."""
        self.no_control.take(control)
        if self._closed:
            raise PipelineError("the pipeline session is closed")
        now = time.perf_counter()
        good, dropped = validate_frames(frames)
        with self._guard():
            self.ranks.check()
            if dropped:
                self.metrics.on_drop(dropped, "non-finite")
            if self._vae_watch is not None and self._vae_watch.news():
                return self._restart_after_overflow(good, now)
            if len(good) and self._frame_shape not in (None, tuple(good.shape[1:])):
                return self._change_size(good, now)
            if len(good):
                self._accept(good, now)
            while len(self._buffer) >= self._chunk_frames():
                n = self._chunk_frames()
                self._enter(_stack(self._buffer[:n]))
                del self._buffer[:n]
            return self._deliver()

    def _change_size(self, good: np.ndarray | torch.Tensor, now: float) -> np.ndarray | torch.Tensor:
        """New input size, as on one GPU: the stream goes on (caches and positions stay), but every
        frame of the old size leaves first (the partial chunk padded, the ring drained), so no
        result mixes two sizes. The new frames wait in the buffer for the next call."""
        out = self._drain_stream()
        self._accept(good, now)
        return out

    def _accept(self, good: np.ndarray | torch.Tensor, now: float) -> None:
        self.metrics.on_input(len(good), now)
        self.slo.observe_input(len(good), now)
        self._buffer.extend(good)
        self._frame_shape = tuple(good.shape[1:])

    def _restart_after_overflow(self, good: np.ndarray | torch.Tensor, now: float) -> np.ndarray | torch.Tensor:
        """As on one GPU (`StreamSession._restart_after_overflow`): the NaN the float16 VAE made stays in its
        history on the last rank and in the KV caches, so the stream ends here as at a flush (every rank resets,
        its KV cache scrubbed, with the next micro-batch) and a new one starts with these frames, which wait in
        the buffer for the next call."""
        self.vae_restarts += 1
        log.warning("the float16 VAE made non-finite frames: a new stream starts (restart %d)", self.vae_restarts)
        out = self._drain_stream()
        self._new_stream(scrub=True)  # the NaN reached the KV caches through the latents
        self._vae_watch.news()  # the old stream's chunks the drain brought back
        if len(good):
            self._accept(good, now)
        return out

    def _drain_stream(self) -> np.ndarray | torch.Tensor:
        """The partial chunk padded as at the end of a stream, the ring drained: every frame still owed."""
        pad = self._pad_partial()
        with torch.inference_mode():
            self._drain()
        return self._deliver(padding=pad)

    def _pad_partial(self) -> int:
        """Enter the partial chunk padded with copies of its last frame; returns the padding."""
        if not self._buffer:
            return 0
        pad = self._chunk_frames() - len(self._buffer)
        self._enter(_stack(self._buffer + [self._buffer[-1]] * pad))
        self._buffer = []
        return pad

    def poll(self, wait: bool = False) -> np.ndarray | torch.Tensor:
        """Frames finished between pushes (a step change drains the ring); otherwise frames leave the
        ring inside a push, which waits for the tick it needs back, and `flush()` drains the ring."""
        return self._deliver()

    def flush(self) -> np.ndarray | torch.Tensor:
        """End of stream: pad the last partial chunk, drain the ring, return every remaining frame."""
        with self._guard():
            out = self._drain_stream()
            self._new_stream()
            return out

    def while_waiting(self, fn: Callable[[], None] | None) -> None:
        """`fn` runs while rank 0 waits for the last rank's returns (see `EngineSession.while_waiting`)."""
        self._waiting = fn

    def _chunk_frames(self) -> int:
        return FIRST_CHUNK_FRAMES if self._stream_chunks == 0 else FRAMES_PER_LATENT * self.slo.plan.chunk_latents

    def _deliver(self, padding: int = 0) -> np.ndarray | torch.Tensor:
        outs, self._outputs = self._outputs, []
        if not outs:
            return np.zeros((0, 0, 0, 3), np.uint8)
        result = torch.cat(outs) if isinstance(outs[0], torch.Tensor) else np.concatenate(outs)
        if padding:
            result = result[:-padding]
        self.metrics.on_output(len(result))
        return result

    @torch.inference_mode()
    def _enter(self, frames: np.ndarray | torch.Tensor) -> None:
        """A new chunk: preprocess, motion noise, encode, its noise draws, then a tick of the ring."""
        chunk_id, first = self._next_chunk, self._stream_chunks == 0
        self._next_chunk += 1
        self._stream_chunks += 1
        self._chunks[chunk_id] = _Chunk(frames, first)
        timer = self.stage.timer
        with timer.span("preprocess"):
            x = self.mapper.to_model(frames)
        t0 = self.motion.first_step(self.motion.update(x, self._prev_last, frames, self._prev_last_u8))
        self._prev_last, self._prev_last_u8 = x[-1], frames[-1]
        with timer.span("encode"):
            pixels = vae_pixels(x, vae_layout(self.device))
            z = self._vae_graphs.run("encode", self.models.encoder.encode_stream, pixels, self.enc_state)
        self._count("in", z.shape[2])
        self._chunks[chunk_id].source = dit_source(self.models.dit.cfg, z, pixels, self.cfg.control.context_scale)
        # The noise draws in the one-GPU denoiser's order: it drains its stream-batch rows before a
        # sequential chunk or a chunk of another size
        plan, shape = self.slo.plan, tuple(z.shape)
        batch = plan.mode == "batch" and self.n > 1 and not first
        if not batch or any(r is not None and r[1] != shape for r in self.ledger.rows):
            self.ledger.drain()
        (self.ledger.batch if batch else self.ledger.sequential)(chunk_id, shape)
        sigma0 = self._first_sigma(t0)
        row = _Row(chunk_id, 0, self.schedule.add_noise(z, self.ledger.take(chunk_id, 0), sigma0), sigma0)
        context, changed = self.prompt.advance()
        if changed:
            self._flags |= NEW_CONTEXT
            self._context = context[None]
        if self.prompt.transition_done:
            self._flags |= REFRESH_SINKS
        if plan.mode == "sequential":  # the chunk goes round the ring n times alone, then leaves
            self._drain()
            for _ in range(self.n):
                self._send_tick(row)
                back = self._receive(self._inflight.popleft())
                row = back[0] if back else None
        else:
            self._send_tick(row)
        self._slo_chunks += 1
        if self.scheduler is not None:
            self.scheduler.tick()
        self._schedule()
        if self.cfg.stream.mode == "auto":
            self.slo.decide()

    def _first_sigma(self, t0: torch.Tensor | float) -> torch.Tensor | float:
        """As `StreamDenoiser._first_sigma`: the chunk's own first step, above the list's second."""
        lo = self.cfg.stream.steps[1] + 1 if self.n > 1 else 1
        hi = self.schedule.train_timesteps - 1
        t0 = t0.clamp(lo, hi) if isinstance(t0, torch.Tensor) else min(max(t0, lo), hi)
        return self.schedule.sigma(t0)

    def _send_tick(self, new: _Row | None) -> None:
        """Tick t: the new chunk's row plus the rows tick t-P returned, one message per run of equal length."""
        rows = [new] if new is not None else []
        if len(self._received) + len(self._inflight) >= self.P:  # tick t sends what tick t-P returned
            rows += self._received.popleft() if self._received else self._receive(self._inflight.popleft())
        rows.sort(key=lambda r: r.step)
        groups: list[list[_Row]] = []
        for r in rows:
            if groups and groups[-1][-1].latent.shape == r.latent.shape:
                groups[-1].append(r)
            else:
                groups.append([r])
        sent = [self._send_rows(g) for g in groups]
        self._inflight.append(sent)
        self._tick += 1
        self.stage.window_ticks += 1

    def _send_rows(self, rows: list[_Row]) -> Header:
        latents = torch.cat([r.latent for r in rows])
        sigmas = torch.stack([_scalar(r.sigma, latents) for r in rows])
        noise = torch.cat([self.ledger.take(r.chunk, r.step + 1) if r.step + 1 < self.n
                           else torch.zeros_like(r.latent) for r in rows])
        header = Header(Kind.DATA, self._tick, rows[0].step, latents.shape[2], tuple(r.chunk for r in rows),
                        self._flags, self._context.shape[1] if self._flags & NEW_CONTEXT else 0)
        context = self._context.to(self.dtype) if self._flags & NEW_CONTEXT else None
        self._flags = 0
        self._count("rows", len(rows) * header.frames)
        if rows[-1].step == self.n - 1:
            self._count("out", header.frames)
        self.stage.apply(header.flags, context)
        source = (torch.cat([self._chunks[r.chunk].source for r in rows])
                  if self.models.dit.cfg.source_channels else None)
        with self.stage.timer.span("embed"):  # fixed work of rank 0, apart from its blocks' ("dit")
            tokens, cond, _ = self.models.dit.embed(latents, self.stage.timesteps(sigmas), source)
        with self.stage.timer.span("dit"):
            tokens = self.stage.run(tokens, cond, header.first_step, header.frames)
        self.link.send_header(self.ranks.outbox, header)
        send_payload(self.link, 1, Payload(tokens, sigmas, latents, noise, context, source))
        return header

    def _receive(self, sent: list[Header], keep: bool = True) -> list[_Row]:
        """The returns of one tick from the last rank: its next-step rows (returned), and the
        frames of a chunk that leaves."""
        rows: list[_Row] = []
        for h in sent:
            t = time.perf_counter()
            back = self.link.recv_header(self.ranks.inbox, self.ranks.check, self._waiting)
            self._wait_s += time.perf_counter() - t
            if (back.tick, back.chunks) != (h.tick, h.chunks):
                raise PipelineError(f"out of order: expected tick {h.tick} rows {h.chunks}, got {back.tick} "
                                    f"rows {back.chunks}")
            src = self.P - 1
            latents = self.link.recv((back.rows, self.models.dit.cfg.in_channels, back.frames, *self.stage.latent_hw),
                                     self.dtype, src, back=True)
            for j, chunk in enumerate(back.chunks):
                step = back.first_step + j + 1
                if step < self.n and keep:
                    rows.append(_Row(chunk, step, latents[j:j + 1], self.sigmas[step]))
            if back.out_frames:
                h_px, w_px = self.cfg.resolution.height, self.cfg.resolution.width
                pixels = self.link.recv((1, 3, back.out_frames, h_px, w_px), self.dtype, src, back=True)
                if self._vae_watch is not None:
                    self._vae_watch.check(pixels)
                chunk = self._chunks.pop(back.chunks[-1])
                self._chunks_done += 1
                if keep:
                    with self.stage.timer.span("postprocess"):
                        out = self.mapper.to_host(pixels[0].permute(1, 0, 2, 3), chunk.frames)
                        self._outputs.append(out if isinstance(chunk.frames, torch.Tensor) else out.cpu().numpy())
        self._collect_timings()
        return rows

    def _collect_timings(self) -> None:
        for name, _, seconds in self.stage.timer.collect():
            self.metrics.stage(name, seconds)
            self.stage.window[name] = self.stage.window.get(name, 0.0) + seconds
            rec = self.stage.totals.setdefault(name, [0, 0.0])
            rec[0] += 1
            rec[1] += seconds

    # ----------------------------------------------------------------------------- telemetry
    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Stream metrics plus every rank's stage times and a split that would balance them;
        `reset` then starts all of them afresh (after a warm-up)."""
        with self._guard():
            self._collect_timings()
            self.link.send_header(self.ranks.outbox, Header(Kind.STATS, extra={"reset": reset}))
            ranks = [self.stage.report(0, self._wait_s), *self.ranks.await_events("stats", self.P - 1)]
        ranks.sort(key=lambda r: r["rank"])
        snap = self.metrics.snapshot()
        snap.update({"gpus": self.P, "split": list(self.split), "ranks": ranks, "block_moves": self.moves,
                     "placement": [str(w) for w in placement(self.split)],
                     "suggested_split": suggest_split(ranks, self._chunks_done, sum(self.split)),
                     "steps": list(self.cfg.stream.steps), "device": str(self.device),
                     "plan": {"mode": self.slo.plan.mode, "chunk_latents": self.slo.plan.chunk_latents},
                     "noise_scale": self.motion.telemetry()[0], "motion": self.motion.telemetry()[1],
                     "prompt": self.prompt.text, "prompt_error": self.prompt.error,
                     "prompt_blend": self.prompt.weight, "lora_scales": self.models.lora.scales,
                     **({"control": edge_control(self.cfg)} if self.cfg.source_edges else {}),
                     **({"vae_nonfinite_chunks": self._vae_watch.chunks(), "vae_restarts": self.vae_restarts}
                        if self._vae_watch is not None else {})})
        if reset:
            self.metrics.restart()  # the stream goes on: the chunks in the ring keep their push times
            self.stage.totals.clear()
            self._wait_s, self._chunks_done = 0.0, 0
        return snap


def _stack(frames: list[np.ndarray | torch.Tensor]) -> np.ndarray | torch.Tensor:
    return torch.stack(frames) if isinstance(frames[0], torch.Tensor) else np.stack(frames)


def _scalar(sigma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    if isinstance(sigma, torch.Tensor):
        return sigma.to(device=like.device, dtype=torch.float32).reshape(())
    return torch.tensor(sigma, device=like.device, dtype=torch.float32)

