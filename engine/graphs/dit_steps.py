"""CUDA graphs over the streaming DiT step.

One streaming forward of the 1.3B model launches a few thousand small kernels; launched one by
one from Python the GPU waits on the host (host time exceeds GPU work several times over; figures
in docs/performance.md). The step's shapes are fixed in steady state, so its device work is
captured once per distinct plan and replayed.

What varies between chunks splits cleanly: the host-side plan (which ring slots a chunk writes,
which rows commit, whether sinks may change) picks the graph, and the device-side inputs (the
latent chunk, timesteps, RoPE cos/sin of the current positions, sink-update inputs, the prompt's
cross-attention K/V) are copied into the graph's static input buffers before each replay. Ring
slots cycle, so steady state needs only a handful of graphs. The first time a plan is seen it
runs eagerly (that is also the warm-up the capture needs); the second time it is captured.
Transitional forwards (pipeline fill and drain, masked attention before the window is full)
simply run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from loom_live.engine.cache.kv_cache import CrossKV, KVCache, SinkPlan, StreamStep
from loom_live.engine.graphs.capture_clock import CAPTURES

MAX_GRAPHS = 64  # distinct plans kept (a sequential chunk's rows each their own); more: not steady, stop capturing


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    t: torch.Tensor
    step: StreamStep
    out: torch.Tensor
    inputs: dict[str, torch.Tensor]


class GraphedStreamForward:
    """Drop-in for `model.forward_stream` on CUDA that replays captured graphs when it can."""

    def __init__(self, model) -> None:
        self.model = model
        self._seen: set[tuple] = set()
        self._graphs: dict[tuple, _Captured] = {}
        self._pool = None
        self._cross = StaticCross()
        self.replays = 0

    def reset(self) -> None:
        """Forget every graph (the cache or the model changed)."""
        self._seen.clear()
        self._graphs.clear()
        self._cross = StaticCross()

    def __call__(self, x: torch.Tensor, timestep: torch.Tensor, cache: KVCache, cross: CrossKV,
                 commit: bool = True, **inputs: torch.Tensor) -> torch.Tensor:
        """`inputs`: further per-chunk device tensors of the model's `stream_step` (VACE's control
        latents and scale), copied into static buffers like the latents."""
        m = self.model
        tokens_grid = (x.shape[2], x.shape[3] // m.cfg.patch_size[1], x.shape[4] // m.cfg.patch_size[2])
        if not x.is_cuda or tokens_grid[1:] != cache.token_grid:
            return m.forward_stream(x, timestep, cache, cross, commit, **inputs)
        step = cache.plan(x.shape[2], commit)
        key = _key(x, timestep, cache, step, inputs)
        if key is None or (key not in self._graphs and (key not in self._seen or len(self._graphs) >= MAX_GRAPHS)):
            self._seen.add(key)
            out = m.stream_step(x, timestep, cache, cross, step, **inputs)
            cache.finish(step)
            return out
        static_cross, reshaped = self._cross.update(cross)
        if reshaped:
            self._graphs.clear()
        if key not in self._graphs:
            self._graphs[key] = self._capture(x, timestep, cache, static_cross, step, inputs)
        cap = self._graphs[key]
        cap.x.copy_(x)
        cap.t.copy_(timestep)
        for name, t in inputs.items():
            cap.inputs[name].copy_(t)
        _copy_step(cap.step, step)
        cap.graph.replay()
        self.replays += 1
        cache.finish(step)
        return cap.out.clone()

    def _capture(self, x, timestep, cache, cross, step, inputs) -> _Captured:
        static_x, static_t = x.clone(), timestep.clone()
        static_inputs = {name: t.clone() for name, t in inputs.items()}
        static_step = _clone_step(step)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(x.device)
        with CAPTURES.timed(), torch.cuda.graph(graph, pool=self._pool):
            out = self.model.stream_step(static_x, static_t, cache, cross, static_step, **static_inputs)
        if self._pool is None:
            self._pool = graph.pool()
        return _Captured(graph, static_x, static_t, static_step, out, static_inputs)


class StaticCross:
    """Cross-attention K/V in fixed buffers, which captured graphs read; a new prompt's K/V is
    copied into them, so the graphs stay valid across prompt changes of the same shape."""

    def __init__(self) -> None:
        self.buffers: CrossKV | None = None
        self._source: CrossKV | None = None

    def update(self, cross: CrossKV) -> tuple[CrossKV, bool]:
        """The buffers holding `cross`, and whether they were made anew (graphs must be recaptured)."""
        reshaped = self.buffers is None or _cross_shape(self.buffers) != _cross_shape(cross)
        if reshaped:
            self.buffers = CrossKV({i: t.clone() for i, t in cross.k.items()},
                                   {i: t.clone() for i, t in cross.v.items()})
        elif cross is not self._source:  # the blocks whose K/V changed (all, for a new prompt)
            for i in cross.k:
                if self._source is None or cross.k[i] is not self._source.k[i]:
                    self.buffers.k[i].copy_(cross.k[i])
                if self._source is None or cross.v[i] is not self._source.v[i]:
                    self.buffers.v[i].copy_(cross.v[i])
        self._source = cross
        return self.buffers, reshaped


def _key(x: torch.Tensor, t: torch.Tensor, cache: KVCache, step: StreamStep,
         inputs: dict[str, torch.Tensor] | None = None) -> tuple | None:
    if step.mask is not None:
        return None  # the window is still filling: transitional, run eagerly
    sinks = None if step.sinks is None else (step.sinks.eligible is None, step.sinks.forced is None,
                                             step.sinks.pinned is None)
    writes = tuple(tuple(r) for r in step.writes)
    first_k = next(iter(cache.k.values()))
    return (tuple(x.shape), x.dtype, tuple(t.shape), first_k.data_ptr(), writes, tuple(step.commit),
            tuple(step.forced_sink), sinks, step.k_rope is None,
            tuple((name, tuple(v.shape), v.dtype) for name, v in sorted((inputs or {}).items())))


def _cross_shape(cross: CrossKV) -> tuple:
    return tuple((i, tuple(t.shape), t.dtype) for i, t in cross.k.items())


def _clone_opt(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def _clone_step(step: StreamStep) -> StreamStep:
    sinks = None
    if step.sinks is not None:
        s = step.sinks
        sinks = SinkPlan(_clone_opt(s.eligible), _clone_opt(s.forced), s.last_pos.clone(), _clone_opt(s.pinned))
    k_rope = None if step.k_rope is None else tuple(t.clone() for t in step.k_rope)
    return replace(step, q_rope=tuple(t.clone() for t in step.q_rope), k_rope=k_rope, sinks=sinks)


def _copy_step(static: StreamStep, new: StreamStep) -> None:
    for a, b in zip(static.q_rope, new.q_rope):
        a.copy_(b)
    if static.k_rope is not None:
        for a, b in zip(static.k_rope, new.k_rope):
            a.copy_(b)
    if static.sinks is not None:
        for name in ("eligible", "forced", "last_pos", "pinned"):
            dst = getattr(static.sinks, name)
            if dst is not None:
                dst.copy_(getattr(new.sinks, name))
