"""The edit family's stream: B frames in, one UNet call, B frames out (the `EngineSession` Protocol).

Per batch of B frames, top to bottom:

1. side stream: frames to the model size, tiny-VAE encode of the sources;
2. encoder thread (its own stream): every `prompt_refresh_every` batches, Qwen3-VL reads the
   instruction with one representative frame (broadcast to the batch) or all B; the result is
   used from the next batch on. Between refreshes the cached conditioning is reused: with a fixed
   instruction it drifts slowly, and the encoder is the most expensive stage. With
   `encoder_split` = n > 1 a refresh runs as n parts, one started per batch (the vision tower in
   one batch's slot, the language model in the next), so no single batch meets the whole burst;
   its result is used from n batches after the one that started it;
3. flow threads: every `cond_refresh_every` batches, the previous output is warped onto each new
   frame (Farneback) on the CPU, and the adapter's condition buffers are rewritten in place before
   the next batch's UNet call;
4. main stream: after the side stream's event, the compiled UNet + LLLite (one graph, fixed
   shapes: it never recompiles), the Euler step, tiny-VAE decode, frames back to the caller.

The host never waits for the GPU on this path: streams are ordered with events, results go back
through pinned memory, and a push returns the batches already finished. The GPU work of batch
n+1's side stream runs while batch n's UNet and decode occupy the main stream. Thread jobs hand
their results over at fixed batch indices (the next batch, or the batch after a refresh's last
part), never "when ready", which keeps the output a function of the input alone (the same frames
with one stream or two, fast machine or slow).

A partial batch waits for more frames; `flush` pads it with its last frame and returns only the
real ones, so every pushed frame comes back exactly once, whatever the push sizes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import numpy as np
import torch

from loom_live.engine.config import LoomConfig
from loom_live.engine.edit.encoder import EncodePart
from loom_live.engine.edit.flow import warp_batch
from loom_live.engine.edit.loading import LATENT_SCALE, EditModels, load_edit_models
from loom_live.engine.edit.schedule import EulerFlowSchedule
from loom_live.engine.startup_progress import STARTUP_PROGRESS
from loom_live.engine.stream.cpu_threads import usable_cores
from loom_live.engine.stream.cuda_streams import edit_streams
from loom_live.engine.stream.frames import FrameMapper, validate_frames
from loom_live.engine.stream.metrics import StreamMetrics
from loom_live.engine.stream.no_vace import NoStructureControl
from loom_live.engine.stream.output_queue import OutputQueue
from loom_live.engine.stream.prompts import check_prompt
from loom_live.engine.stream.stage_timer import StageTimer
from loom_live.engine.stream.warmup_pace import WarmupPace

log = logging.getLogger(__name__)

WARMUP_BATCHES = 3


def flow_threads(batch: int, cores: int) -> int:
    """Threads for the condition's flow: half the cores (the rest run the caller, the encoder's
    thread and the host), at least two, at most one per frame. The batch after a flow's start waits
    for it, so its time is latency every frame in flight pays."""
    return max(1, min(batch, max(2, cores // 2)))


class EditSession:
    """A live stream through the edit family. Not thread-safe: drive it from one thread."""

    raw_passthrough = False

    def __init__(self, cfg: LoomConfig, models: EditModels, compile_backend: Any = "inductor") -> None:
        self.no_control = NoStructureControl("the edit model (model.family=edit)")
        e = cfg.edit
        self.cfg, self.models = cfg, models
        self.device, self.dtype = models.device, models.dtype
        self.batch = e.batch
        self.latent_hw = (cfg.resolution.height // LATENT_SCALE, cfg.resolution.width // LATENT_SCALE)
        self.schedule = EulerFlowSchedule(e.steps, *self.latent_hw, models.shift)
        self.mapper = FrameMapper(cfg.resolution.width, cfg.resolution.height, cfg.resolution.resize,
                                  self.device, self.dtype)
        self.timer = StageTimer(self.device)
        streams = edit_streams(self.device, two_streams=e.two_streams, main_priority=e.main_priority)
        self._main, self._side, self._encoder_stream = streams.main, streams.side, streams.encoder
        self._encoder_thread = ThreadPoolExecutor(1, thread_name_prefix="edit-encoder")
        self._flow_thread = ThreadPoolExecutor(1, thread_name_prefix="edit-flow")
        self._flow_pool = ThreadPoolExecutor(flow_threads(self.batch, usable_cores()),
                                             thread_name_prefix="edit-warp")
        self._time_ids = torch.tensor([[cfg.resolution.width, cfg.resolution.height]] * self.batch,
                                      device=self.device, dtype=self.dtype)
        self._timesteps = [torch.full((self.batch,), self.schedule.timestep(i), device=self.device, dtype=self.dtype)
                           for i in range(self.schedule.steps)]
        # one graph per stage, each compiled once for the fixed batch shape: UNet + adapter + Euler on the
        # main stream, and the autoencoder's two halves (encode on the side stream, decode on the main)
        self._denoise, self._vae_encode, self._vae_decode = (
            torch.compile(fn, backend=compile_backend, fullgraph=True, dynamic=False) if e.compile else fn
            for fn in (self._denoise_eager, models.vae.encode, models.vae.decode_latents))
        _check_text(models.encoder, cfg.prompt.text)  # a prompt the encoder cannot read fails here, at load
        self._prompt_text = cfg.prompt.text
        log.info("edit session: %s UNet, B=%d, %dx%d, %d step(s), %d adapter hooks, %s, %s", e.unet, self.batch,
                 cfg.resolution.width, cfg.resolution.height, e.steps,
                 0 if models.lllite is None else len(models.lllite.modules_dict),
                 "compiled" if e.compile else "eager", "two streams" if e.two_streams else "one stream")
        self.prompt_encodes = 0
        self.prompt_parts = 0
        self.cond_refreshes = 0
        self._prompt_jobs: list[Future] = []
        self._cond_job: Future | None = None
        self.reset()

    @classmethod
    def from_config(cls, cfg: LoomConfig, warmup: bool = True, warmup_share: float = 1.0) -> EditSession:
        """Load the models the config names and start a stream (warmed up on a GPU, paced by `warmup_share`
        below 1)."""
        STARTUP_PROGRESS.say("loading the model")
        session = cls(cfg, load_edit_models(cfg))
        if warmup and session.device.type == "cuda":
            session.warmup(share=warmup_share)
        return session

    def warmup(self, batches: int = WARMUP_BATCHES, share: float = 1.0) -> None:
        """Compile and autotune on synthetic frames, then start afresh; `share` below 1 rests after each
        batch so the warm-up takes that share of the time (a standby beside a show)."""
        STARTUP_PROGRESS.say(f"compiling and warming up on {batches * self.batch} frames")
        pace = WarmupPace(share, self.device)
        h, w = self.cfg.resolution.height, self.cfg.resolution.width
        frames = np.random.default_rng(0).integers(0, 256, (batches * self.batch, h, w, 3), np.uint8)
        for start in range(0, len(frames), self.batch):
            self.push(frames[start:start + self.batch])
            pace.chunk_done()
        self.flush()
        self.reset()
        self.prompt_encodes = self.prompt_parts = self.cond_refreshes = 0

    # ----------------------------------------------------------------------------- lifecycle
    @torch.inference_mode()
    def reset(self) -> None:
        """Start a new stream: buffered frames, cached conditioning, adapter condition, metrics.

        A conditioning job still running is waited for first, so no work of the old stream runs
        on into the new one; one that failed is left with the old stream (its error is not raised here,
        or a failed refresh would refuse every reset after it)."""
        wait([job for job in (*self._prompt_jobs, self._cond_job) if job is not None])
        self._buffer: list[np.ndarray | torch.Tensor] = []
        self._frame_shape: tuple[int, ...] | None = None
        self._index = 0
        self._ctx: tuple[torch.Tensor, torch.Tensor, Any] | None = None
        self._prompt_jobs = []  # the running refresh's parts started so far
        self._prompt_parts: deque[EncodePart] = deque()  # and those still to start, one per batch
        self._refresh_due = False
        self._cond_job = None
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None  # previous batch's last (input, output)
        self._outputs = OutputQueue(self.device, max_unfinished=1)
        self._encoder_spans: deque[tuple[Any, Any, float]] = deque()
        self.metrics = StreamMetrics(self.cfg.slo.latency_budget_ms / 1000.0)
        if self.models.lllite is not None:
            with _on(self._main):
                self.models.lllite.clear_condition()
        gen = torch.Generator().manual_seed(self.cfg.edit.seed)
        noise = torch.randn(1, 4, *self.latent_hw, generator=gen)  # the same noise for every frame
        self._noise = noise.expand(self.batch, -1, -1, -1).contiguous().to(self.device, self.dtype)

    def close(self) -> None:
        for pool in (self._encoder_thread, self._flow_thread, self._flow_pool):
            pool.shutdown(wait=True, cancel_futures=True)
        self._outputs.clear()

    def __enter__(self) -> EditSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_prompt(self, text: str, transition_chunks: int | None = None) -> None:
        """A new instruction, encoded with the next batch and used from the one after it.

        There is no blend between instructions here (`transition_chunks` is accepted for the
        shared interface): the conditioning is a VLM reading, not a text embedding to slerp.
        """
        text = check_prompt(text, "edit")
        _check_text(self.models.encoder, text)  # refused here, the stream going on with the instruction it has
        self._prompt_text = text
        self._refresh_due = True

    def set_reference(self, image: Any) -> None:
        self.no_control.reference(image)

    def set_params(self, **params: Any) -> None:
        """Live parameters (the edit family's share of the schema, `LoomConfig.live_params`); unknown keys
        or bad values raise ValueError naming them."""
        self.cfg = self.cfg.with_live(params)
        self.metrics.set_budget(self.cfg.slo.latency_budget_ms / 1000.0)
        if self.models.lllite is not None:
            with _on(self._main):  # ordered after the UNet calls already queued
                self.models.lllite.set_strength(self.cfg.edit.adapter_strength)

    # ----------------------------------------------------------------------------- streaming
    @property
    def accepts_device_frames(self) -> bool:
        return self.device.type == "cuda"

    @property
    def unfinished(self) -> int:
        """Batches whose frames are computed or queued but not yet returned."""
        return len(self._outputs)

    def push(self, frames: np.ndarray | torch.Tensor, control: Any = None) -> np.ndarray | torch.Tensor:
        """Take uint8 RGB frames [N, H, W, 3]; return the finished outputs, oldest first."""
        self.no_control.take(control)
        now = time.perf_counter()
        good, dropped = validate_frames(frames)
        if dropped:
            self.metrics.on_drop(dropped, "non-finite")
        with torch.inference_mode():
            resized = len(good) and self._frame_shape not in (None, tuple(good.shape[1:]))
            if resized:  # a new input size: the old frames leave first, in their own batch, all of them now
                self._run_partial()
                out = self._ready(wait=True)
            if len(good):
                self._frame_shape = tuple(good.shape[1:])
                self.metrics.on_input(len(good), now)
                self._buffer.extend(good.clone() if isinstance(good, torch.Tensor) else good.copy())
            if resized:  # one size per result: the new frames go in with the next call
                return out
            while len(self._buffer) >= self.batch:
                self._run(self._take(self.batch), self.batch)
            return self._ready(wait=False)

    def poll(self, wait: bool = False) -> np.ndarray | torch.Tensor:
        with torch.inference_mode():
            return self._ready(wait)

    def while_waiting(self, fn: Callable[[], None] | None) -> None:
        """`fn` runs while a push, poll or flush waits for a batch on the GPU (`OutputQueue.waiting`)."""
        self._outputs.waiting = fn

    def flush(self) -> np.ndarray | torch.Tensor:
        """End of stream: the partial batch padded and run, every remaining output, a fresh state."""
        with torch.inference_mode():
            self._run_partial()
            out = self._ready(wait=True)
        metrics = self.metrics
        self.reset()
        self.metrics = metrics
        return out

    def _take(self, n: int) -> np.ndarray | torch.Tensor:
        taken, self._buffer = self._buffer[:n], self._buffer[n:]
        return torch.stack(taken) if isinstance(taken[0], torch.Tensor) else np.stack(taken)

    def _run_partial(self) -> None:
        """Every buffered frame: whole batches, then the rest padded to one."""
        while len(self._buffer) >= self.batch:
            self._run(self._take(self.batch), self.batch)
        if not self._buffer:
            return
        keep = len(self._buffer)
        frames = self._take(keep)
        pad = [frames[-1:]] * (self.batch - keep)
        frames = torch.cat([frames, *pad]) if isinstance(frames, torch.Tensor) else np.concatenate([frames, *pad])
        self._run(frames, keep)

    def _run(self, frames: np.ndarray | torch.Tensor, keep: int) -> None:
        """One batch: side stream, conditioning hand-overs, main stream (see the module docstring)."""
        index, self._index = self._index, self._index + 1
        if self._side is not None:  # device frames were made on the caller's stream
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            if isinstance(frames, torch.Tensor) and frames.is_cuda:  # and are read on these two
                frames.record_stream(self._side)
                frames.record_stream(self._main)
        with _on(self._side):
            with self.timer.span("side.preprocess"):
                x = self.mapper.to_model(frames)
            with self.timer.span("side.vae_encode"):
                ref = self._vae_encode(x)
            side_done = _record(self._side)
        ctx, mask = self._conditioning(index, x, side_done)
        with _on(self._main):
            if self._side is not None and self._side is not self._main:
                self._main.wait_stream(self._side)
                x.record_stream(self._main)
                ref.record_stream(self._main)
            self._condition_adapter(index, x)
            with self.timer.span("main.unet"):
                latents = self._denoise(self._noise, ref, ctx, mask)
            with self.timer.span("main.vae_decode"):
                y = self._vae_decode(latents)
            with self.timer.span("main.postprocess"):
                out = self.mapper.to_host(y[:keep], frames[:keep])
            self._last = (x[keep - 1], y[keep - 1])
            self._outputs.add(out, to_host=not isinstance(frames, torch.Tensor))

    def _denoise_eager(self, noise: torch.Tensor, ref: torch.Tensor, ctx: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """UNet + adapter + Euler over the schedule: the graph that is compiled."""
        x = noise
        for i in range(self.schedule.steps):
            v = self.models.unet(torch.cat([x, ref], dim=3), self._timesteps[i], ctx, mask, self._time_ids,
                                 self.models.lllite)
            x = self.schedule.step(i, x, v[..., :x.shape[-1]])
        return x

    # ----------------------------------------------------------------------------- conditioning
    def _conditioning(self, index: int, x: torch.Tensor, ready: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached VLM conditioning for this batch; advances the running refresh by one part, or
        hands it over, and starts the refresh this batch is due for.

        A refresh due while another runs (a new prompt, or `prompt_refresh_every` under the split)
        starts at the batch that hands the running one over: one refresh at a time, at indices that
        depend on the input alone."""
        e = self.cfg.edit
        self._refresh_due |= self._ctx is None or index % e.prompt_refresh_every == 0
        if self._prompt_parts:  # a split refresh runs: its next part in this batch's slot
            self._start_part(ready)
        elif self._prompt_jobs:  # its last part started one batch ago: it had a whole batch to finish
            with self._host_wait("host.wait_prompt"):
                self._ctx = self._take_refresh()
        if not self._prompt_jobs and self._refresh_due:
            self._start_refresh(x, ready)
        ctx, mask, done = self._ctx
        if done is not None:
            self._main.wait_event(done)
            ctx.record_stream(self._main)
            mask.record_stream(self._main)
        return ctx, mask

    def _start_refresh(self, x: torch.Tensor, ready: Any) -> None:
        """Cut a refresh into its parts and start the first; a stream's first batch runs them all now."""
        e, encoder = self.cfg.edit, self.models.encoder
        self._refresh_due = False
        source = x[:1] if e.prompt_one_frame else x
        if self._encoder_stream is not None:
            source.record_stream(self._encoder_stream)
        parts = ([partial(encoder.encode, self._prompt_text, source)] if e.encoder_split == 1
                 else encoder.encode_parts(self._prompt_text, source, e.encoder_split))
        self._prompt_parts.extend(parts)
        self.prompt_encodes += 1
        self._start_part(ready)
        if self._ctx is None:  # the stream's first batch has nothing cached to use meanwhile
            while self._prompt_parts:
                self._start_part(ready)
            self._ctx = self._take_refresh()

    def _start_part(self, ready: Any) -> None:
        part = self._prompt_parts.popleft()
        self._prompt_jobs.append(self._encoder_thread.submit(self._encode_job, part, ready, not self._prompt_parts))
        self.prompt_parts += 1

    def _take_refresh(self) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """The finished refresh's conditioning; a part that failed raises here, the first one first."""
        jobs, self._prompt_jobs = self._prompt_jobs, []
        return [job.result() for job in jobs][-1]

    def _encode_job(self, part: EncodePart, ready: Any, last: bool) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        """On the encoder thread and stream, after this batch's side stream: one part of a refresh;
        the last returns the [B, L, D] conditioning."""
        stream = self._encoder_stream
        with torch.inference_mode(), _on(stream):
            if stream is not None:
                stream.wait_event(ready)
            start, t0 = _record(stream, timing=True), time.perf_counter()
            out = part()
            if last:
                ctx, mask = out
                if ctx.shape[0] != self.batch:
                    ctx, mask = ctx.expand(self.batch, -1, -1).contiguous(), mask.expand(self.batch, -1).contiguous()
                out = ctx.to(self.dtype), mask
            end = _record(stream, timing=True)
            self._encoder_spans.append((start, end, time.perf_counter() - t0))
            return (*out, _record(stream)) if last else None

    def _condition_adapter(self, index: int, x: torch.Tensor) -> None:
        """On the main stream: hand over a finished warp, and start the one this batch is due for."""
        lllite = self.models.lllite
        if lllite is None:
            return
        if self._cond_job is not None:
            with self._host_wait("host.wait_flow"):
                warped = self._cond_job.result()
            warped = _to_device(torch.from_numpy(warped), self.device)
            lllite.set_condition(warped.permute(0, 3, 1, 2).to(self.dtype) / 127.5 - 1.0)
            self._cond_job = None
        if index % self.cfg.edit.cond_refresh_every:
            return
        self.cond_refreshes += 1
        if self._last is None:  # a stream's first batch: its own frames are the condition
            lllite.set_condition(x)
        elif self.cfg.edit.flow == "none":
            lllite.set_condition(self._last[1][None].expand_as(x))
        else:
            host = [_to_pinned_u8(t) for t in (self._last[1][None], self._last[0][None], x)]
            done = _record(self._main)
            self._cond_job = self._flow_thread.submit(self._flow_job, host, done)

    @contextmanager
    def _host_wait(self, stage: str) -> Iterator[None]:
        """Wall time the caller's thread blocks on a worker: what a handover adds to every frame in flight."""
        t0 = time.perf_counter()
        yield
        self.metrics.stage(stage, time.perf_counter() - t0)

    def _flow_job(self, host: list[torch.Tensor], done: Any) -> np.ndarray:
        if done is not None:
            done.synchronize()  # this worker waits for the copies, the stream does not
        prev_out, prev_in, frames = (t.numpy() for t in host)
        return warp_batch(prev_out[0], prev_in[0], frames, self._flow_pool)

    # ----------------------------------------------------------------------------- outputs
    def _ready(self, wait: bool) -> np.ndarray | torch.Tensor:
        with self._host_wait("host.wait_gpu"):
            outputs = self._outputs.take(wait_all=wait)
        self._collect_timings()
        if not outputs:
            return np.zeros((0, 0, 0, 3), np.uint8)
        result = torch.cat(outputs) if isinstance(outputs[0], torch.Tensor) else np.concatenate(outputs)
        self.metrics.on_output(len(result))
        return result

    def _collect_timings(self) -> None:
        for stage, _, seconds in self.timer.collect():
            self.metrics.stage(stage, seconds)
        while self._encoder_spans:
            start, end, wall = self._encoder_spans[0]
            if end is not None and not end.query():
                break
            self._encoder_spans.popleft()
            self.metrics.stage("side.prompt_encode", start.elapsed_time(end) / 1000.0 if end is not None else wall)

    def stats(self) -> dict[str, Any]:
        snap = self.metrics.snapshot()
        lllite = self.models.lllite
        snap.update({
            "family": "edit",
            "batch": self.batch,
            "batches": self._index,
            "prompt": self._prompt_text,
            "prompt_encodes": self.prompt_encodes,
            "encoder_split": self.cfg.edit.encoder_split,
            "prompt_parts": self.prompt_parts,
            "cond_refreshes": self.cond_refreshes,
            "lllite_hooks": 0 if lllite is None else len(lllite.modules_dict),
            "device": str(self.device),
            "gpu_memory_peak_bytes": (torch.cuda.max_memory_allocated(self.device)
                                      if self.device.type == "cuda" else None),
        })
        return snap


def _check_text(encoder: Any, text: str) -> None:
    """The encoder's own refusal of an instruction it cannot read (an encoder wrapped without one reads any)."""
    check = getattr(encoder, "check_text", None)
    if check is not None:
        check(text)


def _on(stream: torch.cuda.Stream | None) -> Any:
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _record(stream: torch.cuda.Stream | None, timing: bool = False) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor onto the device through pinned memory: a pageable copy would wait for the stream."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _to_pinned_u8(x: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] in [-1, 1] -> uint8 [N, H, W, 3] on the host, copied without a host wait on CUDA."""
    u8 = ((x.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    if u8.device.type != "cuda":
        return u8
    host = torch.empty(u8.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(u8, non_blocking=True)
    return host
