"""Stream state for the video VAEs: the frame history each causal layer carries between chunks.

A causal video VAE sees a stream one chunk at a time. Every layer that looks back in time (a
causal 3D conv needs its last 2 input frames, a temporal downsample its last input frame, a
TAEHV memory block the previous frame) keeps those frames here, not on the module, so a
stream can be reset, copied, or run beside another stream through the same weights.

Fast-path rules the buffers follow: each history buffer is allocated once, on the first chunk,
with a fixed shape (room for a steady step's frames behind the history, where a layer's input is
put together: `through`), and later chunks overwrite it in place (`copy_`). A steady-state chunk step
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
        self._moves: dict[str, tuple[int, int, int]] = {}  # key -> (frames, t, dim) of `through`, until `commit`
        self.started = False
        self.signature: tuple | None = None

    def extend(self, key: str, x: torch.Tensor, frames: int, dim: int = 2) -> torch.Tensor:
        """Return `x` with the layer's last `frames` frames in front, as a new tensor; remember the new
        last ones.

        At the start of a stream the history is zeros, which is exactly the causal zero padding
        a one-shot pass over the whole clip would use.
        """
        history = self._buffer(key, x, frames, dim, room=0).narrow(dim, 0, frames)
        full = torch.cat([history, x], dim=dim)
        history.copy_(full.narrow(dim, full.shape[dim] - frames, frames))
        return full

    def through(self, key: str, x: torch.Tensor, frames: int, layer: Callable[[torch.Tensor], torch.Tensor],
                dim: int = 2) -> torch.Tensor:
        """`layer([history | x])`; at `commit` the last `frames` frames of that input become the history.

        The layer's input is put together in the history's own buffer, which has room behind the
        history for a step's frames: `x` is written there and the layer reads the whole, so no
        history is copied into a new tensor. The frames move to the front at `commit`, after the
        step, and not here: inside a compiled step a second write into the buffer (after the layer
        has read it) comes out as a pass over the whole buffer, where a copy after the step moves
        only the history's frames. Each layer goes through once per step; a `layer` may not keep
        its input (the next step overwrites it).
        """
        t = x.shape[dim]
        buf = self._buffer(key, x, frames, dim, room=t)
        # the first frames + t frames, as `narrow` would give them; but a compiled step writes into a
        # slice of a buffer with room left behind it in place only when the layer reads such a view
        size = list(buf.shape)
        size[dim] = frames + t
        whole = buf.as_strided(size, buf.stride())
        whole.narrow(dim, frames, t).copy_(x)
        self._moves[key] = (frames, t, dim)
        return layer(whole)

    def commit(self) -> None:
        """End a step: each layer that went through it keeps the last frames of its input as its history."""
        for key, (frames, t, dim) in self._moves.items():
            buf = self.buffers[key]
            last = buf.narrow(dim, t, frames)
            buf.narrow(dim, 0, frames).copy_(last if t >= frames else last.clone())  # t < frames: they overlap
        self._moves.clear()

    def remember(self, key: str, x: torch.Tensor, frames: int, dim: int = 2) -> None:
        """Store the last `frames` frames of `x` (which must have at least that many) as the history."""
        buf = self._buffer(key, x, frames, dim, room=x.shape[dim])
        buf.narrow(dim, 0, frames).copy_(x.narrow(dim, x.shape[dim] - frames, frames))

    def start_zero(self, key: str, like: torch.Tensor, frames: int, dim: int = 2) -> None:
        """Hold a zero history for a layer that skips the stream's first call (the history it starts from
        anyway), shaped and laid out as `through` would make it from `like`: the stream's next call then
        meets the same buffers as every later one, so a compiled step sees one signature, not two."""
        self._buffer(key, like, frames, dim, room=like.shape[dim])

    def _buffer(self, key: str, x: torch.Tensor, frames: int, dim: int, room: int) -> torch.Tensor:
        """The layer's buffer: its history in the first `frames` frames along `dim`, then room for at
        least `room` more (`through`). A buffer with room has room for a steady step (one latent's
        frames) from the first call, whose frames are fewer: a larger buffer later would be a new
        input to a compiled step. Growing keeps the history; another shape, dtype or device starts
        from zeros (a stream's later chunks keep the first one's, `check_signature`)."""
        want = frames + (max(room, FRAMES_PER_LATENT) if room else 0)
        buf = self.buffers.get(key)
        same = buf is not None and _same_frame(buf, x, dim)
        if same and buf.shape[dim] >= want:
            return buf
        shape = list(x.shape)
        shape[dim] = want
        new = x.new_zeros(shape)
        channels_last = x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d)
        if channels_last and not x.is_contiguous():
            new = new.contiguous(memory_format=torch.channels_last_3d)
        if same:
            new.narrow(dim, 0, frames).copy_(buf.narrow(dim, 0, frames))
        self.buffers[key] = new
        return new

    def reset(self) -> None:
        """Start a new stream. Buffers are zeroed in place (not freed) so a captured graph stays valid."""
        for buf in self.buffers.values():
            buf.zero_()
        self._moves.clear()
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


def _same_frame(buf: torch.Tensor, x: torch.Tensor, dim: int) -> bool:
    """Whether `buf` holds frames of `x`'s kind: the same shape but along `dim`, dtype and device."""
    return (buf.dtype == x.dtype and buf.device == x.device and buf.dim() == x.dim()
            and all(a == b for i, (a, b) in enumerate(zip(buf.shape, x.shape)) if i != dim))
