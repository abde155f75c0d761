"""CUDA graphs over one pipeline rank's blocks, for the steady-state micro-batch.

The same reasoning as `engine/graphs/dit_steps.py` (launching a block's few hundred small kernels one
by one from Python leaves the GPU waiting on the host), applied to a rank's block range: the
host-side plan of the micro-batch picks the graph, the device-side inputs (tokens, the
modulation, RoPE tables and sink-update inputs of the plan, the prompt's cross K/V) are copied
into the graph's static buffers before each replay. Only full micro-batches (all n step rows)
against a full window are captured; fill, drain and the first chunks run eagerly. A plan runs
eagerly the first time it is seen (the warm-up capture needs) and is captured the second time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loom_live.engine.cache.kv_cache import CrossKV, KVCache, StreamStep
from loom_live.engine.graphs.capture_clock import CAPTURES
from loom_live.engine.graphs.dit_steps import MAX_GRAPHS, StaticCross, _clone_step, _copy_step, _key

log = logging.getLogger(__name__)

BlockRun = Callable[[torch.Tensor, torch.Tensor, CrossKV, KVCache, StreamStep], torch.Tensor]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    mod: torch.Tensor
    step: StreamStep
    out: torch.Tensor


class GraphedBlocks:
    """Replays captured graphs of `run(tokens, mod, cross, cache, step)` when the plan allows."""

    def __init__(self, run: BlockRun) -> None:
        self.run = run
        self._seen: set[tuple] = set()
        self._graphs: dict[tuple, _Captured] = {}
        self._pool = None
        self._cross = StaticCross()
        self.replays = 0
        self.error: str | None = None

    def __call__(self, tokens: torch.Tensor, mod: torch.Tensor, cross: CrossKV, cache: KVCache,
                 step: StreamStep) -> torch.Tensor:
        key = _key(tokens, mod, cache, step)
        fresh = key not in self._graphs and (key not in self._seen or len(self._graphs) >= MAX_GRAPHS)
        if self.error is not None or key is None or fresh:
            self._seen.add(key)
            return self.run(tokens, mod, cross, cache, step)
        static_cross, reshaped = self._cross.update(cross)
        if reshaped:
            self._graphs.clear()
        if key not in self._graphs:
            try:
                self._graphs[key] = self._capture(tokens, mod, static_cross, cache, step)
            except RuntimeError as exc:  # a failed capture leaves the stream usable: stay eager, say why
                self.error = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, running eagerly: %s", self.error)
                self._graphs.clear()
                return self.run(tokens, mod, cross, cache, step)
        cap = self._graphs[key]
        cap.tokens.copy_(tokens)
        cap.mod.copy_(mod)
        _copy_step(cap.step, step)
        cap.graph.replay()
        self.replays += 1
        return cap.out.clone()

    def _capture(self, tokens, mod, cross, cache, step) -> _Captured:
        static_tokens, static_mod, static_step = tokens.clone(), mod.clone(), _clone_step(step)
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(tokens.device)
        # thread_local: the NCCL watchdog thread keeps querying its events while this thread captures
        with CAPTURES.timed(), torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.run(static_tokens, static_mod, cross, cache, static_step)
        if self._pool is None:
            self._pool = graph.pool()
        return _Captured(graph, static_tokens, static_mod, static_step, out)
