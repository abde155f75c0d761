"""Stream state for the video VAEs: the frame history each causal layer carries between chunks.

A causal video VAE sees a stream one chunk at a time. Every layer that looks back in time (a
causal 3D conv needs its last 2 input frames, a temporal downsample its last input frame, a
TAEHV memory block the previous frame) keeps those frames here, not on the module, so a
stream can be reset, copied, or run beside another stream through the same weights.

Fast-path rules the buffers follow: each history buffer is allocated once, on the first chunk,
with a fixed shape, and later chunks overwrite it in place (`copy_`). A steady-state chunk step
therefore reads and writes the same memory every time, which is what lets it be captured in a
CUDA graph (`GraphedStep`) or compiled once; nothing here reads values back to the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FRAMES_PER_LATENT = 4  # Wan's temporal compression: a steady step is 4 frames <-> 1 latent


class FrameCache:
    """Per-direction (encode or decode) histories, keyed by the owning layer's name.

    `started` is False until the first chunk has gone through: some layers treat the very
    first frame of a stream specially (Wan's temporal resampling passes it through alone).
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.started = False
        self.signature: tuple | None = None

    def extend(self, key: str, x: torch.Tensor, frames: int, dim: int = 2) -> torch.Tensor:
        """Return `x` with the layer's last `frames` frames in front; remember the new last ones.

        At the start of a stream the history is zeros, which is exactly the causal zero padding
        a one-shot pass over the whole clip would use.
        """
        history = self._buffer(key, x, frames, dim)
        full = torch.cat([history, x], dim=dim)
        history.copy_(full.narrow(dim, full.shape[dim] - frames, frames))
        return full

    def remember(self, key: str, x: torch.Tensor, frames: int, dim: int = 2) -> None:
        """Store the last `frames` frames of `x` (which must have at least that many)."""
        self._buffer(key, x, frames, dim).copy_(x.narrow(dim, x.shape[dim] - frames, frames))

    def last(self, key: str) -> torch.Tensor:
        return self.buffers[key]

    def _buffer(self, key: str, x: torch.Tensor, frames: int, dim: int) -> torch.Tensor:
        shape = list(x.shape)
        shape[dim] = frames
        buf = self.buffers.get(key)
        if buf is None or list(buf.shape) != shape or buf.dtype != x.dtype or buf.device != x.device:
            buf = x.new_zeros(shape)
            channels_last = x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)
            if channels_last and not x.is_contiguous():
                buf = buf.contiguous(memory_format=torch.channels_last_3d)
            self.buffers[key] = buf
        return buf

    def reset(self) -> None:
        """Start a new stream. Buffers are zeroed in place (not freed) so a captured graph stays valid."""
        for buf in self.buffers.values():
            buf.zero_()
        self.started = False
        self.signature = None

    def copy(self) -> FrameCache:
        other = FrameCache()
        other.buffers = {k: v.clone() for k, v in self.buffers.items()}
        other.started = self.started
        other.signature = self.signature
        return other

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class VAEStreamState:
    """Everything one video stream needs between chunks: an encode and a decode history."""

    def __init__(self) -> None:
        self.encoder = FrameCache()
        self.decoder = FrameCache()

    def reset(self) -> None:
        self.encoder.reset()
        self.decoder.reset()

    def copy(self) -> VAEStreamState:
        """An independent snapshot: continuing either stream leaves the other untouched."""
        other = VAEStreamState()
        other.encoder = self.encoder.copy()
        other.decoder = self.decoder.copy()
        return other

    def nbytes(self) -> int:
        return self.encoder.nbytes() + self.decoder.nbytes()


def check_signature(cache: FrameCache, signature: tuple, what: str) -> None:
    """Later chunks of a stream must keep the batch, size and device of the first one (the
    histories have that shape; input dtype does not matter, chunks are cast to the model's)."""
    if cache.signature is None:
        cache.signature = signature
    elif cache.signature != signature:
        raise ValueError(
            f"{what}: this chunk has (batch, height, width, device) = {signature} but the stream "
            f"started with {cache.signature}; call state.reset() (or use a new state) to change them"
        )


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
        with torch.cuda.graph(self.graph):
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

    The first chunk of a stream has its own shape and runs whole, eagerly. Later chunks are cut
    into one-latent pieces (4 frames to encode, 1 latent to decode; the stream caches make that
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
            return fn(x, state)
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
