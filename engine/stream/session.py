"""StreamSession: the engine's streaming pipeline, usable in-process and behind the server.

Per chunk of input frames (5 for the first chunk, then 4 per latent frame):
preprocess to [-1, 1] at the model size -> motion-aware noise scale -> Stream-VAE encode ->
few-step causal DiT denoising with the rolling KV cache (stream-batch or sequential) ->
Stream-VAE decode -> frames back at the input size. One output frame per accepted input frame,
in order.

On CUDA the session runs on three streams of its own: the work that does not depend on the
previous chunk (preprocessing, motion inputs, VAE encode), the denoise, and the decode, so the
encode of chunk n+1, the denoise of chunk n and the decode of chunk n-1 can share the GPU (the
DiT's 1560-token GEMMs and attention leave SMs idle that the VAE's convolutions fill); CUDA
events order them. The caller's stream only carries its own frame conversions, so a caller that
synchronises it (the cuda-ipc server does, before each slot read) never waits for the model.
For the overlap to happen across pushes, a push does not wait for its own chunk: it returns the
frames of chunks already finished, leaving at most `stream.max_unfinished_chunks` running
(`poll()` collects them between pushes). On a CPU the same code runs in order and every push
returns its own frames.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loom_live.engine.cache.vae_cache import FRAMES_PER_LATENT
from loom_live.engine.config import LoomConfig
from loom_live.engine.graphs.vae_steps import VAEGraphs
from loom_live.engine.models.dit_source import dit_source
from loom_live.engine.models.loading import LoadedModels, load_models
from loom_live.engine.stream.control import VaceControl
from loom_live.engine.stream.cuda_streams import session_streams
from loom_live.engine.stream.denoiser import StreamDenoiser
from loom_live.engine.stream.frames import FrameMapper, vae_layout, vae_pixels, validate_frames
from loom_live.engine.stream.metrics import StreamMetrics
from loom_live.engine.stream.motion_noise import MotionNoiseController
from loom_live.engine.stream.no_vace import NoStructureControl
from loom_live.engine.stream.nonfinite_watch import watch_for
from loom_live.engine.stream.output_queue import OutputQueue
from loom_live.engine.stream.prompts import PromptConditioner, check_prompt, make_text_encoder
from loom_live.engine.stream.schedule import FlowSchedule
from loom_live.engine.stream.slo_scheduler import MAX_CHUNK_LATENTS, Plan, SLOScheduler, allowed_modes
from loom_live.engine.stream.stage_timer import StageTimer
from loom_live.engine.stream.startup import StartupTimes
from loom_live.engine.stream.warmup_pace import WarmupPace
from loom_live.host_bridge.wire.params import FIRST_CHUNK_FRAMES

log = logging.getLogger(__name__)


@dataclass
class _Chunk:
    """A chunk on its way through the pipeline."""

    frames: np.ndarray | torch.Tensor  # accepted input frames (uint8), for the crop policy's border
    latent: torch.Tensor | None = None
    t0: torch.Tensor | float = 0.0
    ready: torch.cuda.Event | None = None
    first: bool = False  # the stream's first chunk: its own shape, eager, not steady state
    keep: int | None = None  # a padded chunk: only its first `keep` frames are real inputs
    given: np.ndarray | torch.Tensor | None = None  # VACE: the host's control frames (uint8), if it gave them
    control: torch.Tensor | None = None  # VACE: the chunk's control latents
    source: torch.Tensor | None = None  # a model that reads its input: what it gets beside the chunk


def _check_runs(cfg: LoomConfig) -> None:
    """A config this session cannot run is refused in one line: an edit-family or several-GPU config would
    otherwise run the Wan family's defaults on one device, silently not the model it names."""
    where = "`engine.session_api.open_session(cfg)` opens the session any config names"
    if cfg.model.family != "wan":
        raise ValueError(f"model.family: {cfg.model.family!r}; a StreamSession runs the Wan family ('wan'); {where}")
    if cfg.parallel.gpus > 1:
        raise ValueError(f"parallel.gpus: {cfg.parallel.gpus}; a StreamSession runs on one GPU (1), the DiT "
                         f"pipeline over several is PipelineSession; {where}")


class StreamSession:
    """A live stream through the model. Not thread-safe: drive it from one thread."""

    def __init__(self, cfg: LoomConfig, models: LoadedModels) -> None:
        _check_runs(cfg)
        self.cfg = cfg
        self.models = models
        self.device, self.dtype = models.device, models.dtype
        self.schedule = FlowSchedule(shift=cfg.stream.timestep_shift)
        self.mapper = FrameMapper(cfg.resolution.width, cfg.resolution.height, cfg.resolution.resize,
                                  self.device, self.dtype)
        self.timer = StageTimer(self.device)
        # Until the warm-up has compiled the steady shapes, compiling is how they get made; after
        # it, an unseen shape (new size, rare plan) runs eagerly: a compile would stall the stream.
        self._compile_stance = "default"
        cuda = self.device.type == "cuda"
        # low_vram runs the stages one after another: decode on the denoise stream (one memory pool for
        # both: streams do not share cached memory) and no chunk left running, so their memory never coexists
        streams = session_streams(self.device, separate_decode=not cfg.memory.low_vram,
                                  decode_priority=cfg.stream.decode_priority,
                                  merge_stream=cfg.stream.lora_priority and bool(cfg.lora))
        self._side, self._denoise_stream, self._decode_stream = streams.side, streams.denoise, streams.decode
        self._merge_stream = streams.merge
        self._overlapped = cuda and not cfg.memory.low_vram and cfg.stream.max_unfinished_chunks > 0
        self._vae_layout = vae_layout(self.device)
        self._vae_watch = watch_for(models, self.device)
        self.vae_restarts = 0  # new streams started because the float16 VAE made NaN
        text_encoder = make_text_encoder(cfg.prompt.encoder, models.dit.cfg.text_dim, cfg.prompt.path,
                                         _encoder_device(cfg.prompt.device, self.device, cfg.memory.low_vram),
                                         models.dit.cfg.text_len)
        self.prompt = PromptConditioner(text_encoder, cfg.prompt.text, device=self.device, dtype=self.dtype,
                                        transition_chunks=cfg.prompt.transition_chunks, blend_mode=cfg.prompt.blend)
        self.motion = MotionNoiseController(cfg.noise.noise_scale, cfg.noise.ema, cfg.noise.motion_aware,
                                            cfg.noise.estimator)
        self._lora_pending: dict[str, float] = {}
        self.control = VaceControl(cfg, models, self.mapper, self._vae_layout, self._run_encode) if cfg.vace else None
        self.no_control = NoStructureControl(f"model preset {cfg.model.preset!r}")
        self._reference_pending = False  # VACE: a new reference (or none) waits for the next chunk
        self.startup = StartupTimes()  # filled by from_config and warmup: where the start-up went
        self.warmed_plans: list[Plan] = []  # the plans the last warm-up streamed
        self._held_plan = False  # warm-up: the plan is set by the warm-up, not by the scheduler
        self._warm_pace = WarmupPace()  # warm-up: its rests (a share set by `warmup`)
        self._build_parts()
        self.reset()

    @classmethod
    def from_config(cls, cfg: LoomConfig, warmup: bool = True, warmup_share: float = 1.0) -> StreamSession:
        """Load the models the config names (or the embedded default) and start a stream.

        On a GPU the session then warms up (kernel autotuning, compilation, graph capture) on
        synthetic frames, so the first real frame is served at steady-state speed; `warmup_share` below 1
        paces that warm-up (`warmup`).
        """
        _check_runs(cfg)  # before the load: a config of another family would load the Wan defaults and run them
        times = StartupTimes()
        times.note_process_age()
        with times.phase("load"):
            models = load_models(cfg)
        times.detail["load"] = dict(models.load_s)
        with times.phase("session"):
            session = cls(cfg, models)
        session.startup = times
        if warmup and session.device.type == "cuda":
            session.warmup(share=warmup_share)
        else:
            log.info("%s", times.line())
        return session

    def warmup(self, streams: int = 2, chunks: int | None = None, share: float = 1.0) -> None:
        """Run synthetic streams through every stage, then start afresh (metrics included).

        Every plan the SLO scheduler may pick mid-stream (`warmup_plans`: the first, then sequential,
        several latents per chunk) streams once, long enough to meet each chunk shape, ring-slot pattern
        and step graph a long stream of that plan meets, with the RoPE refresh of a long stream brought
        forward into it (`_warm_stream`): they are compiled and captured here rather than in the middle
        of a show, where each would stall one chunk. The first plan streams `streams` times (the later
        ones short: a stream after a reset); `chunks` sets the length of those streams instead. `share`
        below 1 rests after each chunk so the warm-up takes that share of the time (`WarmupPace`: a
        standby warming up beside a show).
        """
        self._warm_pace = WarmupPace(share, self.device)
        plans = self.warmup_plans()
        first = self._warm_schedule(plans[0]) if chunks is None else [plans[0]] * chunks
        with self.startup.phase("warmup"):
            for i in range(streams):
                chunks = first if i == 0 else first[:8]
                with self.startup.part("warmup", f"stream {i + 1} ({len(chunks)} chunks)"):
                    self._warm_stream(chunks, seed=i)
        with self.startup.phase("warmup_plans"):
            for i, plan in enumerate(plans[1:]):
                with self.startup.part("warmup_plans", f"{plan.mode} x{plan.chunk_latents}"):
                    self._warm_stream(self._warm_schedule(plan), seed=streams + i)
            if self.control is not None:
                with self.startup.part("warmup_plans", "grey control"):
                    self._warm_grey_part()
        self.warmed_plans = plans
        self.reset()
        self._compile_stance = "eager_on_recompile"
        if self._warm_pace.rested_s:
            log.info("warm-up rested %.1f s to leave the GPU to a show beside it (share %g)",
                     self._warm_pace.rested_s, share)
        log.info("%s", self.startup.line())
        for line in (self.startup.compile_line(), self.startup.first_calls_line(), self.startup.unsaved_line()):
            if line is not None:
                log.info("%s", line)
        if self.cfg.memory.low_vram and self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand back what autotuning and the warm-up left cached

    def warmup_plans(self) -> list[Plan]:
        """The plans this config can stream: the one a stream starts with, then, with `stream.mode`
        auto (the only setting under which the scheduler moves), every other plan it may pick. With
        one step both modes run the same forwards: one plan per chunk size then."""
        first = Plan(self.slo.modes[0], 1)
        if self.cfg.stream.mode != "auto":
            return [first]
        plans = [first, *(p for p in self.slo.candidates if p != first)]
        if len(self.cfg.stream.steps) == 1:
            plans = [p for i, p in enumerate(plans) if p.chunk_latents not in {q.chunk_latents for q in plans[:i]}]
        return plans

    def _warm_schedule(self, plan: Plan) -> list[Plan]:
        """The plan of each chunk of a warm-up stream of `plan`: the first chunk and those that fill the
        KV window, then, for each ring phase a live stream can enter the plan at (the plans before leave
        the ring at any slot), the pipeline's fill and each ring-slot pattern twice (seen, then captured),
        a one-latent chunk stepping to the next phase in between; one more chunk at the end. Every forward
        of a steady chunk replays a graph keyed on the ring slots it writes (the full batch's, or each cache
        row's in turn in a sequential chunk)."""
        st = self.cfg.stream
        k, n, ring = plan.chunk_latents, len(st.steps), st.num_kv_cache - st.sink
        phases = math.gcd(ring, k)
        segment = [plan] * ((n - 1 if plan.mode == "batch" else 0) + 2 * ring // phases)
        start = [plan] * (1 + -(-st.num_kv_cache // k))
        return start + (segment + [Plan(plan.mode, 1)]) * (phases - 1) + segment + [plan]

    def _warm_stream(self, plans: list[Plan], seed: int) -> None:
        """One synthetic stream, chunk i on `plans[i]`, flushed (its drain shapes run too). Its RoPE
        refresh comes with the chunk `n` chunks before the end, the last whose forwards are steady for
        every cache row, as a long stream's are (`KVCache.refresh_after`)."""
        self._held_plan = True
        try:
            self.reset()
            first = 1 + (FIRST_CHUNK_FRAMES - 1) // FRAMES_PER_LATENT  # a causal VAE: the first frame alone
            sizes = [first] + [p.chunk_latents for p in plans[1:]]
            before = sum(sizes[:max(len(sizes) - len(self.cfg.stream.steps), 0)])
            if before >= self.cfg.stream.num_kv_cache:
                self.denoiser.cache.refresh_after(before)
            h, w = self.cfg.resolution.height, self.cfg.resolution.width
            rng = np.random.default_rng(seed)
            for i, plan in enumerate(plans):
                self.slo.hold(plan)
                count = FIRST_CHUNK_FRAMES if i == 0 else FRAMES_PER_LATENT * plan.chunk_latents
                self.push(rng.integers(0, 256, (count, h, w, 3), np.uint8))
                self._warm_pace.chunk_done()
            self.flush()
        finally:
            self._held_plan = False

    @torch.inference_mode()
    def _warm_grey_part(self) -> None:
        """VACE: encode the control video's grey part up to its fixed point (kept for every stream,
        engine/stream/control_latents.py), which short warm-up streams do not reach: no show encodes it."""
        from loom_live.engine.stream.control_latents import MEMO_LIMIT

        if self.control is None:
            return
        grey = self.control.encoder.inactive
        grey.reset()
        with _on(self._side):  # where a stream's control latents are made (and their memory is)
            like = torch.zeros((1, 3, FRAMES_PER_LATENT, self.cfg.resolution.height, self.cfg.resolution.width),
                               device=self.device, dtype=self.dtype)
            while grey.steady_from is None and len(grey.kept) < MEMO_LIMIT:
                grey.next(like)

    # ----------------------------------------------------------------------------- lifecycle
    @torch.inference_mode()
    def _build_parts(self) -> None:
        """The stream's parts, once: later streams reset them in place (captured CUDA graphs point
        at the caches and VAE states)."""
        cfg = self.cfg
        self.metrics = StreamMetrics(cfg.slo.latency_budget_ms / 1000.0)
        ring = cfg.stream.num_kv_cache - cfg.stream.sink  # a chunk must fit the cache's ring
        modes = allowed_modes(cfg.stream.mode)
        self.slo = SLOScheduler(len(cfg.stream.steps), cfg.slo.target_fps, cfg.slo.latency_budget_ms / 1000.0,
                                initial=Plan(modes[0], 1), allowed_modes=modes,
                                max_chunk_latents=1 if cfg.memory.low_vram else min(MAX_CHUNK_LATENTS, ring),
                                overlapped=self._overlapped)
        self.generator = torch.Generator(self.device).manual_seed(cfg.stream.seed)
        self.enc_state = self.models.encoder.new_stream_state()
        self.dec_state = self.models.decoder.new_stream_state()
        # low_vram: no VAE graphs, whose private memory pools would keep every step's activations
        self._vae_graphs = VAEGraphs(cfg.stream.cuda_graphs and self.device.type == "cuda"
                                     and not cfg.memory.low_vram)
        self.denoiser = self._new_denoiser(self.models.dit.cross_kv(self.prompt.current()[None]))
        self._outputs = OutputQueue(self.device, cfg.stream.max_unfinished_chunks if self._overlapped else 0)

    def _new_denoiser(self, cross: Any) -> StreamDenoiser:
        cfg = self.cfg
        h, w = cfg.resolution.height // 8, cfg.resolution.width // 8
        cache = self.models.dit.new_cache(
            len(cfg.stream.steps), frame_shape=(h, w), num_kv_cache=cfg.stream.num_kv_cache,
            sink=cfg.stream.sink, rope_policy=cfg.stream.rope_policy, refresh_at=cfg.stream.rope_refresh_at,
            sink_threshold=cfg.stream.sink_threshold, device=self.device, dtype=self.dtype)
        graphs = cfg.stream.cuda_graphs and self.device.type == "cuda"
        return StreamDenoiser(self.models.dit, cache, cross, list(cfg.stream.steps), self.schedule,
                              self.generator, cuda_graphs=graphs)

    def reset(self) -> None:
        """Start a new stream: caches, positions, noise, metrics, plan; on the newest prompt asked for,
        arrived in full (a blend under way in the old stream does not carry over)."""
        self.prompt.settle()
        self._new_stream()
        self.metrics.reset()
        self.slo.reset()

    @torch.inference_mode()
    def _new_stream(self, scrub: bool = False) -> None:
        """Every part that holds the stream's state starts afresh; metrics and the scheduler's
        learnt stage times are the caller's to keep (a flush keeps them) or reset. `scrub`: the
        old stream made NaN, which a reset would leave in the KV cache's masked slots."""
        cfg = self.cfg
        if self.device.type == "cuda":  # caches are reset in place: no stream may still be using them
            torch.cuda.synchronize(self.device)
        self.generator = torch.Generator(self.device).manual_seed(cfg.stream.seed)
        self.enc_state.reset()
        self.dec_state.reset()
        cross = self.models.dit.cross_kv(self.prompt.current()[None])
        if self.denoiser.cache.batch == len(cfg.stream.steps):
            self.denoiser.reset(list(cfg.stream.steps), cross, self.generator)
        else:  # a step change that failed half-way left the other shape: build it for the steps asked
            self.denoiser = self._new_denoiser(cross)
        if scrub:  # before a VACE reference is committed into the cache below
            self.denoiser.cache.scrub()
        self.motion.reset()
        self._outputs.clear()
        if self.control is not None:
            self.control.start(self.denoiser)  # with the newest reference: nothing left to swap
        self._reference_pending = False
        self._buffer: list[np.ndarray | torch.Tensor] = []
        self._given: list[np.ndarray | torch.Tensor | None] = []  # VACE: host control frames, one per buffered frame
        self._frame_shape: tuple[int, ...] | None = None  # of the frames accepted last
        self._chunks_started = 0
        self._prev_last: torch.Tensor | None = None
        self._prev_last_u8: np.ndarray | torch.Tensor | None = None
        if self.device.type == "cuda":  # what was reset on this stream is seen by the session's streams
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.prompt.close()
        self.motion.close()

    def __enter__(self) -> StreamSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- controls
    def set_prompt(self, text: str, transition_chunks: int | None = None) -> None:
        """Change the prompt without stalling: encoded in the background, blended in over chunks."""
        self.prompt.request(check_prompt(text), transition_chunks)

    def set_params(self, **params: Any) -> None:
        """Change live parameters; unknown keys or bad values raise ValueError naming them."""
        new = self.cfg.with_live(params)
        if self.control is not None:
            self.control.frames.check_source(new.control.control_source)
        old, self.cfg = self.cfg, new
        if self.control is not None:
            self.control.configure(new.control)
            self.denoiser.set_context_scale(new.control.context_scale)
        self._lora_pending.update({e.key: e.scale for e in new.lora
                                   if self.models.lora.scales.get(e.key) != e.scale})
        budget = new.slo.latency_budget_ms / 1000.0
        self.motion.set_noise(new.noise.noise_scale, new.noise.motion_aware)
        self.prompt.set_transition_chunks(new.prompt.transition_chunks)
        self.slo.set_targets(new.slo.target_fps, budget)
        self.metrics.set_budget(budget)
        if new.stream.mode != old.stream.mode:
            self.slo.allow_modes(allowed_modes(new.stream.mode))
        if new.stream.sink_threshold != old.stream.sink_threshold:
            self.denoiser.set_sink_threshold(new.stream.sink_threshold)
        if new.stream.steps != old.stream.steps:
            self._change_steps(list(new.stream.steps))

    def set_reference(self, image: np.ndarray | None) -> None:
        """VACE: a new reference image (uint8 RGB [H, W, 3] or [1, H, W, 3]; None: none), in effect from the
        next chunk the denoiser runs: it replaces the pinned first entry of the KV cache in place, the
        stream goes on. ValueError, one line, for a model without control blocks, a stream without sinks
        (stream.sink=0) or an unreadable image."""
        if self.control is None:
            self.no_control.reference(image)
        if image is not None and self.cfg.stream.sink < 1:  # as control.reference is refused at load
            raise ValueError("reference image: the reference is pinned as the stream's first sink and this stream "
                             f"keeps none (stream.sink={self.cfg.stream.sink}); start the engine with stream.sink >= 1")
        self.control.set_reference(image)
        self._reference_pending = True

    def _apply_reference(self) -> None:
        """Swap the reference between two forwards on the denoise stream (every chunk in flight sees the
        new one from its next step on, as with a prompt change)."""
        if self._reference_pending:
            self._reference_pending = False
            self.control.swap_reference(self.denoiser)

    def _apply_lora(self) -> set[str]:
        """Merge requested LoRA scale changes between two forwards: after the denoise stream's work so
        far, before its next forward (on the merge stream where there is one, cuda_streams.py). A
        change is spread over the merge's parts, one a chunk (`stream.lora_merge_parts`). Returns the
        layers whose weights changed."""
        lora = self.models.lora
        if not self._lora_pending and lora.settled:
            return set()
        stream = self._merge_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with _on(stream), self.timer.span("lora", None):
            if self._lora_pending:
                rewritten = lora.set_scales(self._lora_pending, spread=True)
            else:
                rewritten = lora.step()
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self._lora_pending.clear()
        return rewritten

    @torch.inference_mode()
    def _change_steps(self, steps: list[int]) -> None:
        """New step list: the chunks in flight leave (decoded as usual), then the denoiser switches."""
        with _on(self._denoise_stream):
            self._emit(self.denoiser.drain())
            self.denoiser.change_steps(steps)
            self.slo.set_steps(len(steps))

    # ----------------------------------------------------------------------------- streaming
    @property
    def accepts_device_frames(self) -> bool:
        """On a GPU the session takes and returns device tensors, so the cuda-ipc server never
        copies frames through the CPU."""
        return self.device.type == "cuda"

    @property
    def raw_passthrough(self) -> bool:
        """Outputs are restyled frames, never the inputs: the server always reads them."""
        return False

    def push(self, frames: np.ndarray | torch.Tensor,
             control: np.ndarray | torch.Tensor | None = None) -> np.ndarray | torch.Tensor:
        """Feed frames (uint8 RGB [N, H, W, 3] or [H, W, 3]); returns the outputs that are finished,
        in order, as a numpy array (or, for tensor input, a tensor on the compute device). On a GPU
        the newest chunk's frames may come from a later push or `poll()`.

        `control` (VACE models, control_source 'video'): one control frame per input frame, of the
        input's size; control frames that do not fit are refused and counted, the frames go on.

        Raises ValueError for input it refuses (dtype, shape), leaving the stream as it was. The
        frame size may change between any two frames (a new output resolution in TouchDesigner,
        say): see `_change_size`.
        """
        now = time.perf_counter()
        good, dropped = validate_frames(frames)
        if dropped:
            self.metrics.on_drop(dropped, "non-finite")
        given = self._given_control(control, good)
        if self._vae_watch is not None and self._vae_watch.news():
            return self._restart_after_overflow(good, now, given)
        if len(good) and self._frame_shape not in (None, good.shape[1:]):
            return self._change_size(good, now, given)
        if len(good):
            self._accept(good, now, given)
        return self._process(self._full_chunks())

    def poll(self, wait: bool = False) -> np.ndarray | torch.Tensor:
        """The outputs that finished since the last call, without new input; `wait`: all of them."""
        with torch.inference_mode():
            return self._ready_outputs(wait)

    @property
    def unfinished(self) -> int:
        """Chunks of output frames not yet returned."""
        return len(self._outputs)

    def while_waiting(self, fn: Callable[[], None] | None) -> None:
        """`fn` runs while a push, poll or flush waits for a chunk on the GPU (`OutputQueue.waiting`)."""
        self._outputs.waiting = fn

    def flush(self) -> np.ndarray | torch.Tensor:
        """End of stream: pad the last partial chunk, drain the pipeline, return every remaining frame.

        The padded frames are processed but not returned. The next push starts a new stream.
        """
        out = self._drain_stream()
        self._new_stream()  # metrics and the scheduler's learning carry over to the next stream
        return out

    def _drain_stream(self) -> np.ndarray | torch.Tensor:
        """The partial chunk padded as at the end of a stream, the pipeline drained: every frame still owed."""
        chunks = self._full_chunks()
        if self._buffer:
            chunks.append(self._padded_chunk())
        return self._process(chunks, drain=True)

    def _given_control(self, control: Any, good: np.ndarray | torch.Tensor) -> list[Any]:
        """The host's control frames, one entry per accepted frame (None where none or refused)."""
        if self.control is None:
            self.no_control.take(control)
            return [None] * len(good)
        if control is None or not len(good):
            return [None] * len(good)
        accepted = self.control.frames.accept(control, good)
        return [None] * len(good) if accepted is None else list(accepted)

    def _change_size(self, good: np.ndarray | torch.Tensor, now: float, given: list[Any]) -> np.ndarray | torch.Tensor:
        """New input size: the stream goes on (the model size, caches and positions stay).

        Every frame of the old size leaves first: the partial chunk padded as at the end of a
        stream, the denoiser drained, and this call waits for all of them, so no result ever mixes
        two sizes. That costs one stall of the chunks in flight, once per size change. The new
        frames wait in the buffer for the next call (all of them: a push may bring several chunks'
        worth), so the old size's buffer is cut into whole chunks first, as `flush` does, and only its
        remainder padded: one padded chunk of the whole buffer could overrun the KV window.
        """
        out = self._drain_stream()
        self._accept(good, now, given)
        return out

    def _restart_after_overflow(self, good: np.ndarray | torch.Tensor, now: float,
                                given: list[Any]) -> np.ndarray | torch.Tensor:
        """The float16 VAE's values outgrew float16: the NaN it made sits in its history (and in the KV cache
        the encoder's latents fed), so every later frame would be broken. The stream ends here as at `flush`
        (the frames in flight leave, one out for each in, the broken ones among them) and a new stream starts,
        its KV cache scrubbed, with these frames, which wait in the buffer for the next call."""
        self.vae_restarts += 1
        log.warning("the float16 VAE made non-finite frames: a new stream starts (restart %d)", self.vae_restarts)
        out = self._drain_stream()
        self._new_stream(scrub=True)
        self._vae_watch.news()  # the old stream's chunks the flush drained (their verdicts landed with them)
        if len(good):
            self._accept(good, now, given)
        return out

    def _accept(self, good: np.ndarray | torch.Tensor, now: float, given: list[Any]) -> None:
        self.metrics.on_input(len(good), now)
        self.slo.observe_input(len(good), now)
        self._buffer.extend(good)
        self._given.extend(given)
        self._frame_shape = tuple(good.shape[1:])

    def _full_chunks(self) -> list[_Chunk]:
        chunks = []
        while len(self._buffer) >= self._next_chunk_frames():
            n = self._next_chunk_frames()
            chunks.append(_Chunk(_stack(self._buffer[:n]), given=_stack_given(self._given[:n])))
            del self._buffer[:n]
            del self._given[:n]
            self._chunks_started += 1
        return chunks

    def _padded_chunk(self) -> _Chunk:
        """The buffered frames (less than a chunk) as a whole chunk, completed with copies of the
        last one; the copies' outputs are not returned."""
        n = len(self._buffer)
        pad = self._next_chunk_frames() - n
        frames = _stack(self._buffer + [self._buffer[-1]] * pad)
        given = _stack_given(self._given + [self._given[-1]] * pad)
        self._buffer, self._given = [], []
        self._chunks_started += 1
        return _Chunk(frames, keep=n, given=given)

    def _next_chunk_frames(self) -> int:
        if self._chunks_started == 0:
            return FIRST_CHUNK_FRAMES
        return FRAMES_PER_LATENT * self.slo.plan.chunk_latents

    def _process(self, chunks: list[_Chunk], drain: bool = False) -> np.ndarray | torch.Tensor:
        if self._side is not None:  # the inputs were stacked or converted on the caller's stream
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), _compile_stance(self._compile_stance):
            with _on(self._denoise_stream):
                self._run_chunks(chunks, drain)
            return self._ready_outputs(wait=drain)  # on the caller's stream, where it will be used

    def _run_chunks(self, chunks: list[_Chunk], drain: bool) -> None:
        for c in chunks:  # side stream: everything that does not wait for the previous chunk
            self._encode(c)
        for c in chunks:
            if self._side is not None:
                torch.cuda.current_stream(self.device).wait_event(c.ready)
            self._denoise(c)
        if drain:
            self._emit(self.denoiser.drain())

    def _ready_outputs(self, wait: bool) -> np.ndarray | torch.Tensor:
        outputs = self._outputs.take(wait_all=wait)
        self._collect_timings()
        if not outputs:
            return np.zeros((0, 0, 0, 3), np.uint8)
        result = torch.cat(outputs) if isinstance(outputs[0], torch.Tensor) else np.concatenate(outputs)
        self.metrics.on_output(len(result))
        return result

    def _run_encode(self, fn: Any, pixels: torch.Tensor, state: Any) -> torch.Tensor:
        """An encode through the session's VAE graphs (the VACE control video's; see `VAEGraphs`)."""
        return self._vae_graphs.run("encode", fn, pixels, state)

    def _encode(self, c: _Chunk) -> None:
        stream = self._side
        # The caching allocator reuses a block once its own stream is past the last use, so a tensor
        # used on another stream is recorded there, or a later chunk could overwrite it in flight.
        consumer = torch.cuda.current_stream(self.device) if stream is not None else None  # the denoise stream
        if stream is not None and _on_gpu(c.frames):
            c.frames.record_stream(stream)  # stacked on the caller's stream, read on this one
        with _on(stream):
            with self.timer.span("preprocess", len(c.frames)):
                x = self.mapper.to_model(c.frames)
            # The stream's first chunk (5 frames, eager, masked attention) says nothing about steady
            # state, so the scheduler does not learn from it (units=None).
            c.first = self._prev_last is None
            prev_u8 = self._prev_last_u8
            if prev_u8 is not None and tuple(prev_u8.shape) != tuple(c.frames.shape[1:]):
                prev_u8 = None  # the input size changed: the optical flow has no previous frame
            scale = self.motion.update(x, self._prev_last, c.frames, prev_u8)
            c.t0 = self.motion.first_step(scale)
            self._prev_last, self._prev_last_u8 = x[-1], c.frames[-1]
            batched = self.control is not None and self.cfg.control.batched_encode
            if batched:  # the control video encoded in the input's VAE call, as a second stream of the batch
                with self.timer.span("control", len(c.frames)):
                    control_pixels = self.control.pixels(x, c.given)
            with self.timer.span("encode", None if c.first else len(c.frames) // FRAMES_PER_LATENT):
                pixels = vae_pixels(x, self._vae_layout)
                both = torch.cat((pixels, control_pixels)) if batched else pixels
                latents = self._vae_graphs.run("encode", self.models.encoder.encode_stream, both, self.enc_state)
                c.latent = latents[:1]
                c.source = dit_source(self.models.dit.cfg, c.latent, pixels, self.cfg.control.context_scale)
            if batched:
                c.control = self.control.assemble(latents[1:], control_pixels)
            elif self.control is not None:
                with self.timer.span("control", len(c.frames)):
                    c.control = self.control.latents(x, c.given)
            if stream is not None:
                c.ready = torch.cuda.Event()
                c.ready.record(stream)
                for t in (c.latent, c.t0, c.control, c.source):
                    if isinstance(t, torch.Tensor):
                        t.record_stream(consumer)

    def _denoise(self, c: _Chunk) -> None:
        self._advance_prompt(rewritten=self._apply_lora())
        self._apply_reference()
        k = c.latent.shape[2]
        d = self.denoiser
        plan = self.slo.plan
        out: list[tuple[torch.Tensor, Any]] = []
        batch = plan.mode == "batch" and d.n > 1 and not c.first
        busy = [r for r in d.rows if r is not None]
        if not batch or (busy and busy[0].latent.shape != c.latent.shape):
            out += d.drain()
        if batch:
            full = d.in_flight + 1 == d.n  # fill forwards run eagerly on fewer rows: not steady state
            with self.timer.span("dit", d.n * k if full else None):
                out += d.push_batch(c.latent, c.t0, c, c.control, c.source)
        else:
            with self.timer.span("dit", None if c.first else (k, d.n)):
                out.append((d.run_sequential(c.latent, c.t0, c.control, c.source), c))
        self._emit(out)
        if self.cfg.stream.mode == "auto" and not self._held_plan:
            self.slo.decide()

    def _emit(self, leaving: list[tuple[torch.Tensor, Any]]) -> None:
        """Decode the chunks that left the denoiser and queue their frames for the caller."""
        stream = self._decode_stream
        for latent, chunk in leaving:
            if stream is not None:  # after the denoise that made `latent`, which stays alive until used there
                stream.wait_stream(torch.cuda.current_stream(self.device))
                latent.record_stream(stream)
                if _on_gpu(chunk.frames):  # the letterbox border is taken from the input frames
                    chunk.frames.record_stream(stream)
            with _on(stream):
                with self.timer.span("decode", None if chunk.first else latent.shape[2]):
                    pixels = self._vae_graphs.run("decode", self.models.decoder.decode_stream, latent,
                                                  self.dec_state)
                    if self._vae_watch is not None:
                        self._vae_watch.check(pixels)
                with self.timer.span("postprocess", pixels.shape[2]):
                    frames = self.mapper.to_host(pixels[0].permute(1, 0, 2, 3), chunk.frames)
                self._outputs.add(frames[:chunk.keep], to_host=not isinstance(chunk.frames, torch.Tensor))

    def _advance_prompt(self, rewritten: set[str] | frozenset[str] = frozenset()) -> None:
        """The prompt's next context; cross-attention K/V made again where it or the weights they are
        computed with (`rewritten`: layers a LoRA merge just changed) changed, for those blocks alone."""
        context, changed = self.prompt.advance()
        if changed:
            self.denoiser.set_context(self.models.dit.cross_kv(context[None]))
        elif rewritten:
            self.denoiser.set_context(self.models.dit.cross_kv_refreshed(self.denoiser.cross, context[None], rewritten))
        if self.prompt.transition_done:
            self.denoiser.cache.refresh_sinks()

    def _collect_timings(self) -> None:
        """Feed finished stage timings to the metrics and the SLO scheduler's latency model.

        units None: not steady state, metrics only. A sequential DiT span covers n forwards of
        k frames each: the scheduler models one forward, so it learns seconds / n per k units.
        """
        for stage, units, seconds in self.timer.collect():
            self.metrics.stage(stage, seconds)
            if units is None or stage not in ("encode", "dit", "decode"):
                continue
            if isinstance(units, tuple):
                k, forwards = units
                self.slo.observe(stage, k, seconds / forwards)
            else:
                self.slo.observe(stage, units, seconds)

    # ----------------------------------------------------------------------------- telemetry
    def stats(self) -> dict[str, Any]:
        """JSON-able snapshot: frames, drops, FPS, latency percentiles, jitter, stages, plan, memory."""
        snap = self.metrics.snapshot()
        cache = self.denoiser.cache
        snap.update({
            "plan": {"mode": self.slo.plan.mode, "chunk_latents": self.slo.plan.chunk_latents},
            "steps": list(self.denoiser.steps),
            "noise_scale": self.motion.telemetry()[0],
            "motion": self.motion.telemetry()[1],
            "prompt": self.prompt.text,
            "prompt_error": self.prompt.error,
            "prompt_blend": self.prompt.weight,
            "prompt_style": self.prompt.match,
            "lora_scales": self.models.lora.scales,
            "startup": self.startup.as_dict(),
            "kv_positions": cache.next_positions,
            **({"control": self.control.stats()} if self.control is not None else {}),
            **({"control": edge_control(self.cfg)} if self.cfg.source_edges else {}),
            **({"vae_nonfinite_chunks": self._vae_watch.chunks(), "vae_restarts": self.vae_restarts}
               if self._vae_watch is not None else {}),
            "kv_cache_bytes": cache.memory_bytes(),
            "device": str(self.device),
            "gpu_memory_peak_bytes": (torch.cuda.max_memory_allocated(self.device)
                                      if self.device.type == "cuda" else None),
        })
        return snap


def edge_control(cfg: LoomConfig) -> dict[str, Any]:
    """What `stats()` says of a model's edge control, as a VACE session says its control (`edges_only`: a
    host knows the control scale is all it takes: no control frames, no reference)."""
    return {"source": "edges", "context_scale": cfg.control.context_scale, "reference": None, "edges_only": True}


def _stack_given(given: list[Any]) -> Any:
    """The host's control frames of a chunk, or None unless every frame of it has one."""
    return None if any(g is None for g in given) else _stack(given)


def _on(stream: torch.cuda.Stream | None) -> Any:
    """Run the block on `stream` (CUDA), or in place (CPU: no streams)."""
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _compile_stance(stance: str) -> Any:
    """`torch.compiler.set_stance(stance)`, where something can have been compiled: setting a stance imports
    torch._dynamo, seconds of an engine's start-up on a CPU, and a process that never imported it
    (`torch.compile` does) holds no compiled function for a stance to govern."""
    return torch.compiler.set_stance(stance) if "torch._dynamo" in sys.modules else nullcontext()


def _on_gpu(frames: np.ndarray | torch.Tensor) -> bool:
    return isinstance(frames, torch.Tensor) and frames.is_cuda


def _stack(frames: list[np.ndarray | torch.Tensor]) -> np.ndarray | torch.Tensor:
    return torch.stack(frames) if isinstance(frames[0], torch.Tensor) else np.stack(frames)


def _encoder_device(setting: str, device: torch.device, low_vram: bool) -> str:
    """Where the text encoder runs: umT5-XXL alone is about 11 GB in bf16, so low_vram keeps it on
    the CPU (a prompt is encoded once per change, off the per-frame path)."""
    if setting == "auto":
        return "cuda" if device.type == "cuda" and not low_vram else "cpu"
    return setting
