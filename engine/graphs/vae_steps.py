"""CUDA graphs for the stream VAEs' steady-state steps.

A steady chunk step reads and writes the same stream-state buffers every time (see
`engine.cache.vae_cache`), so it can be captured once and replayed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loom_live.engine.cache.vae_cache import FRAMES_PER_LATENT, FrameCache, VAEStreamState
from loom_live.engine.graphs.capture_clock import CAPTURES


class GraphedStep:
    """One fixed-shape steady-state stream step replayed as a CUDA graph.

    `step(x)` must be a call such as `lambda x: vae.decode_stream(x, state)` on a state that has
    already seen its first chunk (the first chunk has another shape and runs eagerly). The graph
    reads and writes that state's history buffers in place, so it is tied to that state object:
    `state.reset()` keeps it valid, a `state.copy()` is not driven by it. The returned tensor is
    the graph's static output, overwritten by the next call; clone it if you keep it.
    Warm-up and capture run the step on `example`; pass the `cache` the step drives and its
    histories are put back afterwards, so building the graph does not advance the stream.
    """

    def __init__(self, step: Callable[[torch.Tensor], torch.Tensor], example: torch.Tensor,
                 cache: FrameCache | None = None, warmup: int = 2) -> None:
        if not example.is_cuda:
            raise ValueError("GraphedStep needs CUDA tensors (CUDA graphs are GPU-only)")
        saved = {k: v.clone() for k, v in cache.buffers.items()} if cache is not None else {}
        self.static_in = example.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step(self.static_in)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with CAPTURES.timed(), torch.cuda.graph(self.graph):
            self.static_out = step(self.static_in)
        if cache is not None:
            # Put the histories back; a history first created by the warm-up (a layer the stream's
            # first chunk bypassed) goes back to its not-yet-seen state, which is zeros.
            for key, buf in cache.buffers.items():
                if key in saved:
                    buf.copy_(saved[key])
                else:
                    buf.zero_()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.static_in.copy_(x)
        self.graph.replay()
        return self.static_out


class VAEGraphs:
    """Steady-state encode/decode chunk steps of a session, one latent at a time, captured once and replayed.

    The first step of a stream is its first frame (encode) or first latent (decode) alone, run
    uncompiled and without a graph (it has its own shape and an empty history). Everything after is
    cut into one-latent pieces (4 frames to encode, 1 latent to decode; the stream caches make that
    exact), so a single step shape serves every chunk size the scheduler picks: one CUDA graph
    and one compiled graph per direction, never a capture or compile in the middle of a show.
    Each graph is tied to the session's stream state, which is reset in place, never replaced,
    so the graphs stay valid across streams.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._graphs: dict[tuple, GraphedStep] = {}

    def run(self, direction: str, fn: Callable[[torch.Tensor, VAEStreamState], torch.Tensor],
            x: torch.Tensor, state: VAEStreamState) -> torch.Tensor:
        cache = state.encoder if direction == "encode" else state.decoder
        if not cache.started:
            first = fn(x[:, :, :1], state)
            if x.shape[2] == 1:
                return first
            return torch.cat([first, self.run(direction, fn, x[:, :, 1:], state)], dim=2)
        piece = FRAMES_PER_LATENT if direction == "encode" else 1
        if x.shape[2] > piece and x.shape[2] % piece == 0:
            return torch.cat([self._step(direction, fn, p, state, cache) for p in x.split(piece, dim=2)], dim=2)
        return self._step(direction, fn, x, state, cache)

    def _step(self, direction: str, fn: Callable[[torch.Tensor, VAEStreamState], torch.Tensor],
              x: torch.Tensor, state: VAEStreamState, cache: FrameCache) -> torch.Tensor:
        if not (self.enabled and x.is_cuda):
            return fn(x, state)
        key = (direction, tuple(x.shape), x.dtype, id(state))
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = GraphedStep(lambda t: fn(t, state), x, cache=cache)
        return graph(x).clone()
