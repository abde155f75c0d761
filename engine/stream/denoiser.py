"""Few-step streaming denoising of latent chunks: stream-batch and sequential.

With n steps the KV cache has n rows; row i only ever sees chunks at step i, so its cached
keys come from latents at one noise level. Both modes keep that invariant, which is what makes
switching between them seamless:
- sequential: a chunk goes through rows 0..n-1 one forward each (batch 1); it leaves after n
  forwards, and nothing else is in flight;
- stream-batch: one forward carries up to n chunks, row i holding a different chunk at step i;
  a new chunk enters row 0 and the chunk in row n-1 leaves clean, one chunk per forward.
The pipeline fills row by row and drains row by row (a forward over a contiguous range of
rows), so a mode change, a chunk-size change or a flush never drops or reorders a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loom_live.engine.graphs.dit_steps import GraphedStreamForward
from loom_live.engine.layers.rope import host_index
from loom_live.engine.stream.schedule import FlowSchedule


@dataclass
class InFlight:
    """A chunk inside the stream-batch pipeline."""

    latent: torch.Tensor  # noisy latent [1, C, f, h, w] at the step of the row it sits in
    tag: Any  # whatever the session needs back when the chunk leaves (its input frames, timing)
    control: torch.Tensor | None = None  # VACE control latents of the chunk, beside it at every step
    source: torch.Tensor | None = None  # what a model that reads its input gets beside the chunk (source_channels)


class StreamDenoiser:
    """Owns the KV cache rows and the in-flight chunks; the model is passed in, stateless."""

    def __init__(self, model, cache, cross, steps: list[int], schedule: FlowSchedule,
                 generator: torch.Generator, cuda_graphs: bool = False) -> None:
        self.model = model
        # Steady forwards replay CUDA graphs: the full batch's, and a sequential chunk's one row at a time
        # (its rows are views of the cache, so each row's graph writes in place); fill and drain run eagerly.
        self.graphed_forward = GraphedStreamForward(model) if cuda_graphs else model.forward_stream
        self.cache = cache
        self.cross = cross
        self.schedule = schedule
        self.generator = generator
        self.set_steps(steps)
        self.rows: list[InFlight | None] = [None] * len(steps)
        self._row0_sigma: torch.Tensor | float = self._sigmas[0]
        self.context_scale = 1.0  # VACE: how strongly the control latents steer (a live parameter)
        self.reads_source = bool(getattr(getattr(model, "cfg", None), "source_channels", 0))

    def replace_cache(self, cache) -> None:
        """Use another KV cache (a new step list); captured graphs of the old one are dropped."""
        self.cache = cache
        if isinstance(self.graphed_forward, GraphedStreamForward):
            self.graphed_forward.reset()

    def set_sink_threshold(self, threshold: float) -> None:
        """A new adaptive-sink threshold (a constant inside captured graphs: they are re-captured)."""
        self.cache.set_sink_threshold(threshold)
        if isinstance(self.graphed_forward, GraphedStreamForward):
            self.graphed_forward.reset()

    def set_steps(self, steps: list[int]) -> None:
        self.steps = list(steps)
        self._sigmas = [self.schedule.sigma(s) for s in steps]

    def set_context(self, cross: Any) -> None:
        """New cross-attention K/V (a prompt change), used from the next forward on."""
        self.cross = cross

    def reset(self, steps: list[int], cross: Any, generator: torch.Generator) -> None:
        """A new stream with these steps, prompt context and noise: no chunk in flight, cache rows fresh.

        The cache is reset in place (same shape), so captured graphs, which point at it, stay valid."""
        if len(steps) != self.cache.batch:
            raise ValueError(f"steps: {len(steps)} given; this cache has {self.cache.batch} rows")
        self.cache.reset()
        self.rows = [None] * len(steps)
        self.set_steps(steps)
        self.cross, self.generator = cross, generator

    def change_steps(self, steps: list[int]) -> None:
        """A new step list mid-stream (drain first): each new row takes the cache row of the
        nearest old step, so the new rows keep the stream's history."""
        if self.in_flight:
            raise RuntimeError("drain the stream-batch pipeline before changing the steps")
        old = self.steps
        nearest = [min(range(len(old)), key=lambda i: abs(old[i] - s)) for s in steps]
        self.replace_cache(self.cache.rows(nearest))
        self.set_steps(steps)
        self.rows = [None] * len(steps)

    def set_context_scale(self, scale: float) -> None:
        """VACE: the control strength from the next forward on (an input of captured graphs, not a constant)."""
        self.context_scale = float(scale)

    def add_reference(self, latent: torch.Tensor, control: torch.Tensor) -> None:
        """VACE: commit a reference entry (one clean latent frame and its control frame, at timestep 0)
        into every cache row as the stream's first frame, and pin it there as a fixed first sink."""
        rows = self.cache.batch
        grow = lambda t: t.expand(rows, *t.shape[1:])  # noqa: E731
        self.model.forward_stream(grow(latent), latent.new_zeros(rows), self.cache, self.cross, commit=True,
                                  control=grow(control), context_scale=self._scale(rows, latent))
        self.cache.pin_sinks(1)

    def replace_reference(self, latent: torch.Tensor | None, control: torch.Tensor | None) -> None:
        """VACE, mid-stream: a new reference entry in place of the pinned first sink (or, None, no
        reference: the slot is unpinned and the sinks refresh from the next frames). The entry is computed
        as at a stream's start, alone in a fresh cache row, and its K/V copied into slot 0 of every row
        that holds a frame; a row still empty commits it as its first frame. Chunks in flight keep going."""
        cache = self.cache
        if latent is None:
            cache.pin_sinks(0)
            cache.refresh_sinks()
            return
        empty = [b for b, n in enumerate(cache.frames) if n == 0]
        filled = [b for b, n in enumerate(cache.frames) if n > 0]
        if empty:
            part = cache.rows(empty)
            grow = lambda t: t.expand(len(empty), *t.shape[1:])  # noqa: E731
            self.model.forward_stream(grow(latent), latent.new_zeros(len(empty)), part, self.cross, commit=True,
                                      control=grow(control), context_scale=self._scale(len(empty), latent))
            cache.set_rows(empty, part)
        if filled:
            fresh = cache.rows([filled[0]])
            fresh.reset()
            self.model.forward_stream(latent, latent.new_zeros(1), fresh, self.cross, commit=True,
                                      control=control, context_scale=self._scale(1, latent))
            rows = host_index(filled, cache.device)
            for i in cache.k:
                cache.k[i][rows, 0] = fresh.k[i][0, 0]
                cache.v[i][rows, 0] = fresh.v[i][0, 0]
        cache.pin_sinks(1)

    def _scale(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        return torch.full((rows,), float(self.context_scale), device=like.device, dtype=like.dtype)

    @property
    def n(self) -> int:
        return len(self.steps)

    @property
    def in_flight(self) -> int:
        return sum(r is not None for r in self.rows)

    def _noise(self, like: torch.Tensor) -> torch.Tensor:
        return torch.randn(like.shape, generator=self.generator, device=like.device, dtype=torch.float32).to(like.dtype)

    def _first_sigma(self, t0: torch.Tensor | float) -> torch.Tensor | float:
        """The chunk's own first step, kept strictly above the list's second step."""
        lo = self.steps[1] + 1 if self.n > 1 else 1
        if isinstance(t0, torch.Tensor):
            t0 = t0.clamp(lo, self.schedule.train_timesteps - 1)
        else:
            t0 = min(max(t0, lo), self.schedule.train_timesteps - 1)
        return self.schedule.sigma(t0)

    def _source(self, z: torch.Tensor, given: torch.Tensor | None) -> torch.Tensor | None:
        if not self.reads_source:
            return None
        return z if given is None else given

    def _forward(self, x: torch.Tensor, sigmas: torch.Tensor, first: int, last: int,
                 control: torch.Tensor | None = None, source: torch.Tensor | None = None,
                 graphed: bool = False) -> torch.Tensor:
        """One DiT forward over cache rows [first, last); returns x0 for each row. The full batch's forward,
        and a part's where `graphed` (a sequential chunk's rows: steady, unlike the pipeline's fill and drain),
        replay CUDA graphs."""
        t = sigmas * self.schedule.train_timesteps
        extra = {} if control is None else {"control": control, "context_scale": self._scale(x.shape[0], x)}
        if source is not None:
            extra["source"] = source
        if first == 0 and last == self.n:
            flow = self.graphed_forward(x, t.to(x.dtype), self.cache, self.cross, **extra)
        else:
            cache = self.cache.rows(slice(first, last))
            forward = self.graphed_forward if graphed else self.model.forward_stream
            flow = forward(x, t.to(x.dtype), cache, self.cross, commit=True, **extra)
            self.cache.set_rows(list(range(first, last)), cache)
        return self.schedule.to_x0(x.float(), flow.float(), sigmas.float()).to(x.dtype)

    def run_sequential(self, z: torch.Tensor, t0: torch.Tensor | float,
                       control: torch.Tensor | None = None, source: torch.Tensor | None = None) -> torch.Tensor:
        """Denoise one chunk (with its VACE control latents, if any) through all n rows now; returns its
        clean latent. `source`: what a model that reads its input gets beside it (engine/models/dit_source.py;
        default the clean latents z)."""
        if self.in_flight:
            raise RuntimeError("drain the stream-batch pipeline before a sequential chunk")
        sigma0 = self._first_sigma(t0)
        x = self.schedule.add_noise(z, self._noise(z), sigma0)
        x0, source = z, self._source(z, source)
        for i in range(self.n):
            sig = _row_sigma(sigma0 if i == 0 else self._sigmas[i], x)
            x0 = self._forward(x, sig, i, i + 1, control, source, graphed=True)
            if i + 1 < self.n:
                x = self.schedule.add_noise(x0, self._noise(x0), self._sigmas[i + 1])
        return x0

    def push_batch(self, z: torch.Tensor | None, t0: torch.Tensor | float, tag: Any,
                   control: torch.Tensor | None = None, source: torch.Tensor | None = None
                   ) -> list[tuple[torch.Tensor, Any]]:
        """One stream-batch forward: z (with its VACE control latents and its source, if any, as in
        `run_sequential`) enters row 0 (None to drain); returns chunks that left."""
        if z is not None:
            if self.rows[0] is not None:
                raise RuntimeError("row 0 is occupied")
            busy = [r.latent.shape for r in self.rows if r is not None]
            if busy and busy[0] != z.shape:
                raise RuntimeError("drain the pipeline before changing the chunk shape")
            sigma0 = self._first_sigma(t0)
            self.rows[0] = InFlight(self.schedule.add_noise(z, self._noise(z), sigma0), tag, control,
                                    self._source(z, source))
            self._row0_sigma = sigma0
        active = [i for i, r in enumerate(self.rows) if r is not None]
        if not active:
            return []
        first, last = active[0], active[-1] + 1
        if active != list(range(first, last)):
            raise RuntimeError(f"stream-batch rows must be contiguous, got {active}")
        x = torch.cat([self.rows[i].latent for i in range(first, last)])
        sig = torch.stack([_scalar(self._row0_sigma if i == 0 else self._sigmas[i], x) for i in range(first, last)])
        controls = [self.rows[i].control for i in range(first, last)]
        control = None if controls[0] is None else torch.cat(controls)
        source = torch.cat([self.rows[i].source for i in range(first, last)]) if self.reads_source else None
        x0 = self._forward(x, sig, first, last, control, source)
        out: list[tuple[torch.Tensor, Any]] = []
        moved: list[InFlight | None] = [None] * self.n
        for j, i in enumerate(range(first, last)):
            row = self.rows[i]
            if i == self.n - 1:
                out.append((x0[j:j + 1], row.tag))
            else:
                nxt = self.schedule.add_noise(x0[j:j + 1], self._noise(x0[j:j + 1]), self._sigmas[i + 1])
                moved[i + 1] = InFlight(nxt, row.tag, row.control, row.source)
        self.rows = moved
        return out

    def drain(self) -> list[tuple[torch.Tensor, Any]]:
        """Run the pipeline empty; returns the chunks in the order they leave."""
        out = []
        while self.in_flight:
            out += self.push_batch(None, 0.0, None)
        return out


def _scalar(sigma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    if isinstance(sigma, torch.Tensor):
        return sigma.to(device=like.device, dtype=torch.float32).reshape(())
    # a fill, not torch.tensor: that copies the value from pageable host memory and makes the host wait for the
    # stream, every chunk, holding back the work queued behind it
    return torch.full((), sigma, device=like.device, dtype=torch.float32)


def _row_sigma(sigma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    return _scalar(sigma, like).reshape(1)
