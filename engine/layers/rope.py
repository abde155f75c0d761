"""Wan2.1's 3-axis rotary position embedding, and the position policies for endless streams.

Wan rotates each head's channels in interleaved pairs; the pairs are split between the three
axes (time, height, width) as `d - 4*(d//6)`, `2*(d//6)`, `2*(d//6)` channels, each axis with
its own frequency ladder `theta**(-2j/axis_dim)` over a 1024-entry position table. The tables
are computed once per device (float64 only at build time) and every forward just indexes them.

A stream is endless but the time table is not, and the model only ever saw ~21 latent frames
in training, so cached frames must be given positions that stay small. Two policies:

- `refresh`: positions grow with the stream; when the next chunk would pass `refresh_at`, the
  ring frames and the current position move back together to just after the sinks. Cached
  keys are stored rotated, and since rotations compose, re-rotating the ring keys by `-shift`
  makes them exactly what they would have been at the new positions: distances among ring
  frames and to the current frame are unchanged, only the sink-to-ring gap shrinks.
- `window`: positions are assigned by age within the cache (sinks first, then the ring from
  oldest to newest, then the current chunk), as StreamingLLM does. Keys are stored unrotated
  and rotated when read, so positions never exceed the window length.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

ROPE_THETA = 10000.0
ROPE_TABLE_SIZE = 1024  # positions per axis, as in Wan2.1
ROPE_POLICIES = ("refresh", "window")
GRID_CACHE_SIZE = 8  # recent cos/sin grids kept per table (the window policy cycles through ring-size many)


def axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels per axis (time, height, width) for one head, Wan2.1's split."""
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"head_dim must be even and >= 6 for 3-axis RoPE, got {head_dim}")
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def _axis_table(dim: int, size: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(torch.arange(size, dtype=torch.float64), freqs)
    # Interleaved pairs (2j, 2j+1) share one angle.
    return (
        angles.cos().repeat_interleave(2, dim=1).float(),
        angles.sin().repeat_interleave(2, dim=1).float(),
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of `x` (..., d) by the given cos/sin (broadcastable, float32)."""
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    swapped = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (xf * cos + swapped * sin).to(x.dtype)


class RopeTables:
    """Precomputed cos/sin tables for one head_dim on one device."""

    def __init__(
        self,
        head_dim: int,
        device: torch.device | str = "cpu",
        theta: float = ROPE_THETA,
        size: int = ROPE_TABLE_SIZE,
    ) -> None:
        self.head_dim = head_dim
        self.size = size
        self.device = torch.device(device)
        self.dims = axis_dims(head_dim)
        tables = [_axis_table(d, size, theta) for d in self.dims]
        self.cos = [c.to(self.device) for c, _ in tables]
        self.sin = [s.to(self.device) for _, s in tables]
        self._hw: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._grids: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def spatial(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the height and width channels for an h x w token grid: [h*w, dh+dw]."""
        key = (h, w)
        if key not in self._hw:
            if max(h, w) > self.size:
                raise ValueError(f"token grid {h}x{w} exceeds the {self.size}-entry RoPE table")
            parts = []
            for tab in (self.cos, self.sin):
                hh = tab[1][:h, None, :].expand(h, w, -1)
                ww = tab[2][None, :w, :].expand(h, w, -1)
                parts.append(torch.cat((hh, ww), dim=-1).reshape(h * w, -1))
            self._hw[key] = (parts[0], parts[1])
        return self._hw[key]

    def grid(self, t_positions: torch.Tensor, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for frames at the given time positions (CPU long [..., F]) over an h x w grid.

        Returns float32 tensors [..., F*h*w, 1, head_dim] on the tables' device, ready to
        broadcast over heads. Positions are checked against the table on the host.
        """
        positions = t_positions.tolist()
        key = (repr(positions), h, w)  # a stream cycles through few position patterns: reuse them
        if key in self._grids:
            self._grids.move_to_end(key)
            return self._grids[key]
        if t_positions.numel() and (int(t_positions.max()) >= self.size or int(t_positions.min()) < 0):
            raise ValueError(f"RoPE time positions {positions} are outside 0..{self.size - 1}")
        idx = host_index(positions, self.device)
        hw_cos, hw_sin = self.spatial(h, w)
        out = []
        for t_tab, hw_tab in ((self.cos[0], hw_cos), (self.sin[0], hw_sin)):
            t = t_tab[idx]  # [..., F, dt]
            t = t.unsqueeze(-2).expand(*t.shape[:-1], h * w, t.shape[-1])
            s = hw_tab.expand(*t.shape[:-1], hw_tab.shape[-1])
            out.append(torch.cat((t, s), dim=-1).flatten(-3, -2).unsqueeze(-2))
        self._grids[key] = (out[0], out[1])
        if len(self._grids) > GRID_CACHE_SIZE:
            self._grids.popitem(last=False)
        return out[0], out[1]

    def time_shift(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin over the time channels that move a key by `delta` frames (any sign): [..., dt]."""
        # indexed as a 1-d tensor: a 0-d tensor index is read back to the host as a Python int (a GPU wait)
        mag = delta.abs().reshape(-1)
        sign = torch.where(delta < 0, -1.0, 1.0).to(self.sin[0].dtype).unsqueeze(-1)
        dt = self.cos[0].shape[-1]
        return self.cos[0][mag].reshape(*delta.shape, dt), self.sin[0][mag].reshape(*delta.shape, dt) * sign


def host_index(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """A small index tensor on `device` without stalling the GPU (pinned, non-blocking copy)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def refresh_shift(next_pos: int, chunk_frames: int, kept_ring: int, sink: int, refresh_at: int) -> int:
    """The `refresh` policy: how far to move a row's ring frames and current position back.

    0 while the chunk stays within `refresh_at`; otherwise the shift that puts the kept ring
    frames (positions `next_pos - kept_ring .. next_pos - 1`) at `sink .. sink + kept_ring - 1`.
    """
    if next_pos + chunk_frames <= refresh_at:
        return 0
    shift = next_pos - kept_ring - sink
    if shift <= 0 or next_pos - shift + chunk_frames > refresh_at:
        raise ValueError(
            f"rope refresh_at={refresh_at} is too small for a window of {sink} sinks + {kept_ring} "
            f"ring frames + a {chunk_frames}-frame chunk; raise refresh_at"
        )
    return shift


def window_positions(num_slots: int, sink_slots: Sequence[int], ring_by_age: Sequence[int]) -> list[int]:
    """The `window` policy: each slot's position by age (sinks, then ring oldest..newest).

    Empty slots get position 0 (they are masked out of attention anyway).
    """
    positions = [0] * num_slots
    for rank, slot in enumerate(list(sink_slots) + list(ring_by_age)):
        positions[slot] = rank
    return positions
