"""Streaming self-attention KV cache (sinks + ring, per batch row) and the per-prompt cross K/V.

Layout: per block, K and V of `num_kv_cache` latent-frame slots, `[B, slots, tokens, heads,
head_dim]`, allocated once. Slots `0..sink-1` hold sink frames (the first frames of the stream,
later refreshed), the rest is a ring: a new frame overwrites the oldest ring slot in place, so
the memory stays flat over an endless stream and nothing is ever concatenated or shifted.

Every batch row is an independent stream (stream-batch): rows keep their own frame count,
RoPE position and pending sink refreshes, on the host, so planning a chunk never reads the GPU.
A chunk is written into its slots *before* attention, and attention then runs over all slots
of the row: the attended set is exactly the window that remains after the write (sinks, the
kept ring frames and the chunk itself). While some row still has empty slots an explicit mask
hides them; once every row is full, attention runs unmasked (the fast SDPA/flash path).
A chunk that is not committed is written the same way and the overwritten slots are restored
afterwards, so committed and uncommitted calls compute the same output.

Adaptive sinks: after attention, for each committing row whose sinks are full, the mean K and
mean V of the chunk's last frame are compared (cosine) with each sink's; when the lowest average
similarity is below `sink_threshold` that sink is overwritten by the frame (re-rotated to the
sink's position). The decision is taken per block on the GPU, without a host sync. The frame
also stays in the ring as usual; unlike StreamDiffusionV2, which diverts the ring write into
the sink slot, this keeps ring order and positions identical across blocks and host-known.
`refresh_sinks()` forces the next `sink` committed frames into the sink slots (prompt change).

Pinned sinks: `pin_sinks(n)` keeps the first n sink slots out of both replacements, for an entry
that conditions the whole stream and must stay (VACE's reference image, committed first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from loom_live.engine.layers.attention import attention
from loom_live.engine.layers.rope import (
    ROPE_POLICIES,
    ROPE_TABLE_SIZE,
    RopeTables,
    host_index,
    refresh_shift,
    rotate,
    window_positions,
)

RotateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
SimilarityFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Shift = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [B, dt]: a RoPE time shift of the keys' first dt channels
MergeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Shift | None], None]
AttendFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]

DEFAULT_NUM_KV_CACHE = 6
DEFAULT_SINK = 3
DEFAULT_REFRESH_AT = 50
DEFAULT_SINK_THRESHOLD = 0.2


@dataclass
class CrossKV:
    """Cross-attention keys/values of one prompt for a set of blocks: `k[block]`, `v[block]` are
    [B or 1, text_len, heads, head_dim]. Swapping prompts swaps this object; the self-attention
    cache is untouched."""

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]

    def to(self, device: torch.device | str) -> CrossKV:
        return CrossKV(
            {i: t.to(device) for i, t in self.k.items()}, {i: t.to(device) for i, t in self.v.items()}
        )

    def updated(self, blocks: CrossKV) -> CrossKV:
        """These K/V with `blocks`' entries in place of their own (a weight change that reached a few blocks);
        the other blocks keep their tensors."""
        return CrossKV({**self.k, **blocks.k}, {**self.v, **blocks.v})

    def lerp(self, other: CrossKV, weight: float) -> CrossKV:
        """Blend towards another prompt's K/V (for gradual prompt changes)."""
        return CrossKV(
            {i: torch.lerp(t, other.k[i], weight) for i, t in self.k.items()},
            {i: torch.lerp(t, other.v[i], weight) for i, t in self.v.items()},
        )


@dataclass
class _Row:
    """Host-side bookkeeping of one stream (one batch row)."""

    frames: int = 0  # frames committed since the stream (re)started
    next_pos: int = 0  # RoPE time position of the next frame (refresh policy)
    sink_pending: int = 0  # sink slots still to be overwritten after refresh_sinks()
    pinned: int = 0  # leading sink slots never replaced (adaptive or refreshed)


@dataclass
class StreamStep:
    """Everything one chunk needs in every block, planned once on the host by `KVCache.plan`."""

    frames: int
    commit: list[bool]
    writes: list[list[tuple[int, int, int]]]  # per row: (first slot, first chunk frame, count)
    q_rope: tuple[torch.Tensor, torch.Tensor]  # [B, f*tokens, 1, D]
    k_rope: tuple[torch.Tensor, torch.Tensor] | None  # window policy: [B or 1, slots*tokens, 1, D]
    mask: torch.Tensor | None  # [B, 1, 1, slots*tokens] or None when every row is full
    forced_sink: list[int]  # per row: sink slot a pending refresh_sinks() overwrites, or -1
    sinks: SinkPlan | None  # None when no row may touch its sinks this chunk


@dataclass
class SinkPlan:
    """Device-side inputs of the adaptive-sink update, made once per chunk (not per block)."""

    eligible: torch.Tensor | None  # [B] bool: rows that may replace a sink (None: all rows)
    forced: torch.Tensor | None  # [B] long: sink slot to overwrite unconditionally, -1 none
    last_pos: torch.Tensor  # [B] long: RoPE position of the chunk's last frame
    pinned: torch.Tensor | None = None  # [B] long: leading sink slots that stay (None: none pinned)


class KVCache:
    """Self-attention K/V of a set of blocks for B independent streams. See the module docstring."""

    def __init__(
        self,
        k: dict[int, torch.Tensor],
        v: dict[int, torch.Tensor],
        token_grid: tuple[int, int],
        sink: int,
        rope_policy: str,
        refresh_at: int,
        sink_threshold: float,
        rows: list[_Row] | None = None,
        rope: RopeTables | None = None,
        empty: tuple[tuple[int, ...], torch.device] | None = None,
    ) -> None:
        """`empty`: the (block shape, device) of a cache that holds no block (yet), which a pipeline
        rank without blocks keeps so its bookkeeping runs on as every rank's does."""
        first = next(iter(k.values()), None)
        if first is None and empty is None:
            raise ValueError("a KV cache without blocks needs its block shape and device (empty=...)")
        shape, device = (tuple(first.shape), first.device) if first is not None else empty
        self.batch, self.num_slots, self.frame_tokens, self.heads, self.head_dim = shape
        self.k, self.v = k, v
        self.token_grid = token_grid
        self.sink = sink
        self.ring = self.num_slots - sink
        self.rope_policy = rope_policy
        self.refresh_at = refresh_at
        self.sink_threshold = sink_threshold
        self.device = device
        same = rope is not None and rope.device == self.device
        self.rope = rope if same else RopeTables(self.head_dim, self.device)
        self._rows = rows if rows is not None else [_Row() for _ in range(self.batch)]

    @classmethod
    def allocate(
        cls,
        batch: int,
        token_grid: tuple[int, int],
        heads: int,
        head_dim: int,
        blocks: Sequence[int],
        num_kv_cache: int = DEFAULT_NUM_KV_CACHE,
        sink: int = DEFAULT_SINK,
        rope_policy: str = "refresh",
        refresh_at: int = DEFAULT_REFRESH_AT,
        sink_threshold: float = DEFAULT_SINK_THRESHOLD,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.bfloat16,
    ) -> KVCache:
        """Allocate the cache once; `token_grid` is the (h, w) token grid of one latent frame."""
        if rope_policy not in ROPE_POLICIES:
            raise ValueError(f"rope_policy={rope_policy!r}; allowed: {', '.join(ROPE_POLICIES)}")
        if batch < 1 or num_kv_cache < 1:
            raise ValueError(f"batch ({batch}) and num_kv_cache ({num_kv_cache}) must be >= 1")
        if not 0 <= sink < num_kv_cache:
            raise ValueError(
                f"sink={sink} must be in 0..num_kv_cache-1 ({num_kv_cache - 1}): the ring needs a slot"
            )
        if rope_policy == "refresh" and not num_kv_cache < refresh_at <= ROPE_TABLE_SIZE:
            raise ValueError(f"refresh_at={refresh_at} must be in {num_kv_cache + 1}..{ROPE_TABLE_SIZE}")
        shape = (batch, num_kv_cache, token_grid[0] * token_grid[1], heads, head_dim)
        k = {i: torch.zeros(shape, device=device, dtype=dtype) for i in blocks}
        v = {i: torch.zeros(shape, device=device, dtype=dtype) for i in blocks}
        return cls(k, v, token_grid, sink, rope_policy, refresh_at, sink_threshold,
                   empty=(shape, torch.device(device)))

    # ----- state management -------------------------------------------------------------
    def reset(self, rows: Sequence[int] | None = None) -> None:
        """Start the given rows (default all) as fresh streams. Slot contents are left as they
        are: empty slots are masked, so no memory traffic is needed."""
        for b in range(self.batch) if rows is None else rows:
            self._rows[b] = _Row()

    def scrub(self) -> None:
        """Zero every slot, in place (captured graphs stay valid). A reset leaves old slots as masked
        leftovers, harmless while they are finite; a NaN or inf among them is not (a masked score's
        zero weight times a NaN value is NaN), so a stream that made non-finite values is scrubbed
        before the next one starts."""
        for slots in (*self.k.values(), *self.v.values()):
            slots.zero_()

    def refresh_after(self, frames: int) -> None:
        """Synthetic warm-up streams only: move the `refresh` policy's first RoPE refresh forward, to the
        chunk holding the frame `frames` frames from now (instead of the frame at position `refresh_at`).

        The refresh is the one thing of a long stream the cache meets late: chunk plans, slot patterns
        and so graph keys depend on frame counts, which cycle with the ring, not on positions. Starting
        the ring's positions late (a wider gap between sinks and ring) lets a warm-up meet the refresh
        within a few chunks. Only while no ring frame is in (sinks take their positions by slot, ring
        frames from `next_pos`), and only for a frame past the first full window, where a live refresh
        happens. `reset()` undoes it."""
        if self.rope_policy != "refresh":
            return  # the window policy has no refresh
        held = max(r.frames for r in self._rows)
        if held > self.sink or min(r.frames for r in self._rows) + frames < self.num_slots:
            raise ValueError(f"refresh_after({frames}): a row holds {held} frames; only before the ring's "
                             f"first frame ({self.sink} sinks), for a frame past the {self.num_slots}-frame window")
        for r in self._rows:
            r.next_pos = max(r.next_pos, self.refresh_at - frames)

    def set_sink_threshold(self, threshold: float) -> None:
        """A new adaptive-sink threshold (negative: sinks are never overwritten by similarity)."""
        self.sink_threshold = threshold

    def refresh_sinks(self, rows: Sequence[int] | None = None) -> None:
        """After a prompt change: the next `sink` committed frames replace the sinks one by one."""
        for b in range(self.batch) if rows is None else rows:
            self._rows[b].sink_pending = self.sink - self._rows[b].pinned

    def pin_sinks(self, count: int, rows: Sequence[int] | None = None) -> None:
        """Keep the first `count` sink slots of the given rows (default all) as they are from now on:
        neither adaptive replacement nor `refresh_sinks` touches them. A reset unpins."""
        if not 0 <= count <= self.sink:
            raise ValueError(f"pin_sinks: {count} pinned slots; this cache has {self.sink} sink slots")
        for b in range(self.batch) if rows is None else rows:
            r = self._rows[b]
            r.pinned = count
            r.sink_pending = min(r.sink_pending, self.sink - count)

    def _like(
        self,
        k: dict[int, torch.Tensor],
        v: dict[int, torch.Tensor],
        rows: list[_Row],
        device: torch.device | str | None = None,
    ) -> KVCache:
        return KVCache(
            k,
            v,
            self.token_grid,
            self.sink,
            self.rope_policy,
            self.refresh_at,
            self.sink_threshold,
            rows,
            self.rope,
            empty=((len(rows), *self.block_shape[1:]), self.device if device is None else torch.device(device)),
        )

    def copy(self) -> KVCache:
        """A deep copy (new tensors, same contents and bookkeeping)."""
        return self._like(
            {i: t.clone() for i, t in self.k.items()},
            {i: t.clone() for i, t in self.v.items()},
            [_Row(**vars(r)) for r in self._rows],
        )

    def rows(self, index: int | slice | Sequence[int]) -> KVCache:
        """The selected batch rows as a cache: a view sharing memory for a slice, a copy otherwise."""
        if isinstance(index, int):
            index = slice(index, index + 1)
        picked = range(self.batch)[index] if isinstance(index, slice) else list(index)
        rows = [_Row(**vars(self._rows[b])) for b in picked]
        sel = index if isinstance(index, slice) else host_index(picked, self.device)
        return self._like(
            {i: t[sel] for i, t in self.k.items()}, {i: t[sel] for i, t in self.v.items()}, rows
        )

    def set_rows(self, index: Sequence[int], other: KVCache) -> None:
        """Overwrite rows `index` (contents and bookkeeping) with the rows of `other`, in order.

        Rows of a `rows(slice)` view already live in this cache's memory: only their bookkeeping
        comes back (a self-copy would move the whole row's K/V, hundreds of MB at 480x832)."""
        for j, b in enumerate(index):
            for i in self.k:
                if other.k[i][j].data_ptr() != self.k[i][b].data_ptr():
                    self.k[i][b].copy_(other.k[i][j])
                if other.v[i][j].data_ptr() != self.v[i][b].data_ptr():
                    self.v[i][b].copy_(other.v[i][j])
            self._rows[b] = _Row(**vars(other._rows[j]))

    def to(self, device: torch.device | str) -> KVCache:
        """The same cache on another device (a copy; this one is unchanged)."""
        return self._like(
            {i: t.to(device) for i, t in self.k.items()},
            {i: t.to(device) for i, t in self.v.items()},
            [_Row(**vars(r)) for r in self._rows],
            device,
        )

    def pop_block(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove one block's K/V (to hand it to another pipeline rank with the block)."""
        return self.k.pop(block), self.v.pop(block)

    def put_block(self, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Adopt one block's K/V from another rank (same rows, slots and bookkeeping)."""
        if k.shape != v.shape or tuple(k.shape) != self.block_shape:
            raise ValueError(f"block {block} K/V of shape {tuple(k.shape)} do not fit this cache")
        self.k[block], self.v[block] = k.to(self.device), v.to(self.device)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of one block's K (and V): [B, slots, tokens, heads, head_dim]."""
        return (self.batch, self.num_slots, self.frame_tokens, self.heads, self.head_dim)

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())

    @property
    def blocks(self) -> list[int]:
        return list(self.k)

    @property
    def fill(self) -> list[int]:
        """Filled slots per row."""
        return [min(r.frames, self.num_slots) for r in self._rows]

    @property
    def frames(self) -> list[int]:
        """Frames committed per row since the stream started."""
        return [r.frames for r in self._rows]

    @property
    def positions(self) -> list[list[int | None]]:
        """RoPE time position of every slot per row (None for empty slots)."""
        out = []
        for r in self._rows:
            pos = self._slot_positions(r.frames, r.next_pos)
            out.append([p if s in self._filled_slots(r.frames) else None for s, p in enumerate(pos)])
        return out

    @property
    def next_positions(self) -> list[int]:
        """RoPE time position the next frame of each row would get."""
        return [self._chunk_positions(r.frames, r.next_pos, 1)[0] for r in self._rows]

    # ----- slot arithmetic (host only) --------------------------------------------------
    def _slot_of(self, frame: int) -> int:
        return frame if frame < self.sink else self.sink + (frame - self.sink) % self.ring

    def _ring_count(self, frames: int) -> int:
        return min(max(frames - self.sink, 0), self.ring)

    def _filled_slots(self, frames: int) -> set[int]:
        return set(range(min(frames, self.sink))) | set(
            range(self.sink, self.sink + self._ring_count(frames))
        )

    def _ring_by_age(self, frames: int) -> list[int]:
        return [self._slot_of(j) for j in range(frames - self._ring_count(frames), frames)]

    def _slot_positions(self, frames: int, next_pos: int) -> list[int]:
        """Position of each slot when `frames` frames are in (empty slots: 0)."""
        sinks = list(range(min(frames, self.sink)))
        ring = self._ring_by_age(frames)
        if self.rope_policy == "window":
            return window_positions(self.num_slots, sinks, ring)
        positions = [0] * self.num_slots
        for s in sinks:
            positions[s] = s
        for age, s in enumerate(ring):
            positions[s] = next_pos - len(ring) + age
        return positions

    def _chunk_positions(self, frames: int, next_pos: int, f: int) -> list[int]:
        after = self._slot_positions(frames + f, next_pos + f)
        return [after[self._slot_of(j)] for j in range(frames, frames + f)]

    # ----- one chunk --------------------------------------------------------------------
    def plan(self, chunk_frames: int, commit: bool | Sequence[bool] = True) -> StreamStep:
        """Plan a chunk of `chunk_frames` latent frames for every row (refreshing positions first
        where the `refresh` policy asks for it). Call `attend` per block, then `finish`."""
        f = chunk_frames
        commits = [bool(commit)] * self.batch if isinstance(commit, bool) else [bool(c) for c in commit]
        if len(commits) != self.batch:
            raise ValueError(f"commit has {len(commits)} entries for a cache of {self.batch} rows")
        if not 1 <= f <= self.num_slots:
            raise ValueError(f"chunk of {f} latent frames does not fit a {self.num_slots}-frame KV window")
        writes, q_pos, k_pos, valid = [], [], [], []
        sink_rows, forced, last_pos = [], [], []
        for b, r in enumerate(self._rows):
            to_ring = r.frames + f - max(r.frames, self.sink)
            if to_ring > self.ring:
                raise ValueError(
                    f"chunk of {f} frames overruns the {self.ring}-frame ring (num_kv_cache - sink)"
                )
            if self.rope_policy == "refresh":
                kept = min(self._ring_count(r.frames), self.ring - max(to_ring, 0))
                shift = refresh_shift(r.next_pos, f, kept, self.sink, self.refresh_at)
                if shift:
                    self._shift_ring(b, shift)
                    r.next_pos -= shift
            slots = [self._slot_of(j) for j in range(r.frames, r.frames + f)]
            writes.append(_runs(slots))
            chunk_pos = self._chunk_positions(r.frames, r.next_pos, f)
            q_pos.append(chunk_pos)
            k_pos.append(self._slot_positions(r.frames + f, r.next_pos + f))
            filled = self._filled_slots(r.frames + f)
            valid.append([s in filled for s in range(self.num_slots)])
            sinks_full = r.frames >= self.sink > r.pinned
            sink_rows.append(commits[b] and sinks_full and (self.sink_threshold >= 0 or r.sink_pending > 0))
            forced.append(self.sink - r.sink_pending if commits[b] and sinks_full and r.sink_pending else -1)
            last_pos.append(chunk_pos[-1])
        h, w = self.token_grid
        q_rope = self._rope_rows(q_pos, h, w)
        k_rope = self._rope_rows(k_pos, h, w) if self.rope_policy == "window" else None
        mask = None
        if not all(all(row) for row in valid):
            mask = host_index(valid, self.device).bool()
            mask = mask.repeat_interleave(self.frame_tokens, dim=1)[:, None, None, :]
        sinks = None
        if any(sink_rows):
            sinks = SinkPlan(
                eligible=None if all(sink_rows) else host_index(sink_rows, self.device).bool(),
                forced=host_index(forced, self.device) if any(i >= 0 for i in forced) else None,
                last_pos=host_index(last_pos, self.device),
                pinned=host_index([r.pinned for r in self._rows], self.device)
                if any(r.pinned for r in self._rows) else None,
            )
        return StreamStep(f, commits, writes, q_rope, k_rope, mask, forced, sinks)

    def _rope_rows(self, positions: list[list[int]], h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        if all(p == positions[0] for p in positions):  # common in steady state: one row for all
            cos, sin = self.rope.grid(torch.tensor(positions[:1]), h, w)
            # materialised, not a stride-0 view: a graph's static copy (a clone) must keep the
            # layout the compiled ops were specialised on, or capture would trigger a recompile
            rows = (self.batch, *cos.shape[1:])
            return cos.expand(rows).contiguous(), sin.expand(rows).contiguous()
        return self.rope.grid(torch.tensor(positions), h, w)

    def _shift_ring(self, b: int, shift: int) -> None:
        """Re-rotate row b's ring keys (all blocks) `shift` frames back in time, in place."""
        cos, sin = self.rope.time_shift(torch.full((), -shift, dtype=torch.long, device=self.device))  # no host copy
        dt = cos.shape[-1]
        for k in self.k.values():
            ring = k[b, self.sink :, ..., :dt]
            ring.copy_(rotate(ring, cos, sin))

    def attention(
        self, step: StreamStep, ops: CacheOps | None = None
    ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The self-attention function for `WanDiT.run_blocks` for this planned chunk, with the tensor
        functions of `ops` (default: eager; the DiT passes its compiled ones)."""
        return partial(self.attend, step, ops or EAGER_CACHE_OPS)

    def attend(
        self, step: StreamStep, ops: CacheOps, block: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Self-attention of one block for the planned chunk. q/k/v: [B, f*tokens, H, D], not yet
        rotated. Writes the chunk's K/V into its slots, attends over the row's window, restores
        uncommitted rows, then updates sinks. Returns [B, f*tokens, H, D]."""
        kc, vc = self.k[block], self.v[block]
        q = ops.rotate(q, *step.q_rope)
        if self.rope_policy == "refresh":
            k = ops.rotate(k, *step.q_rope)
        k = k.unflatten(1, (step.frames, self.frame_tokens)).to(kc.dtype)
        v = v.unflatten(1, (step.frames, self.frame_tokens)).to(vc.dtype)
        saved = []
        lockstep = all(step.commit) and all(w == step.writes[0] for w in step.writes[1:])
        for b, runs in [(slice(None), step.writes[0])] if lockstep else enumerate(step.writes):
            for slot, first, n in runs:  # rows in lockstep (every row the same slots): one copy for all
                if not lockstep and not step.commit[b]:
                    saved.append((b, slot, n, kc[b, slot : slot + n].clone(), vc[b, slot : slot + n].clone()))
                kc[b, slot : slot + n] = k[b, first : first + n]
                vc[b, slot : slot + n] = v[b, first : first + n]
        keys, values = kc.flatten(1, 2), vc.flatten(1, 2)
        if torch.is_grad_enabled():  # training (engine/train): the slots change after this attention
            keys, values = keys.clone(), values.clone()  # reads them, so autograd keeps its own copy
        if step.k_rope is not None:
            keys = rotate(keys, *step.k_rope)
        out = ops.attend(q, keys.to(q.dtype), values.to(q.dtype), step.mask)
        for b, slot, n, ks, vs in saved:
            kc[b, slot : slot + n] = ks
            vc[b, slot : slot + n] = vs
        if step.sinks is not None:
            self._update_sinks(step.sinks, kc, vc, k[:, -1], v[:, -1], ops)
        return out

    def _update_sinks(
        self, plan: SinkPlan, kc: torch.Tensor, vc: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
        ops: CacheOps,
    ) -> None:
        """Overwrite, per row, the least similar sink with the chunk's last frame when the mean-K /
        mean-V cosine similarity is below the threshold (or when a sink refresh is pending)."""
        s = self.sink
        sim = ops.sink_similarity(kc[:, :s], vc[:, :s], k_new, v_new)
        if plan.pinned is not None:  # a pinned slot is never the one replaced
            sim = sim.masked_fill(torch.arange(s, device=self.device)[None] < plan.pinned[:, None], float("inf"))
        lowest, idx = sim.min(dim=-1)
        replace = (
            lowest < self.sink_threshold if self.sink_threshold >= 0 else torch.zeros_like(lowest).bool()
        )
        if plan.eligible is not None:
            replace &= plan.eligible
        if plan.forced is not None:
            idx = torch.where(plan.forced >= 0, plan.forced, idx)
            replace |= plan.forced >= 0
        # the merge moves the frame's key to the sink's position as it writes it (refresh)
        shift = self.rope.time_shift(idx - plan.last_pos) if self.rope_policy == "refresh" else None
        # the chosen slot as a mask over every sink slot: indexing it (a gather and a scatter) and eager
        # broadcasting writes are slow kernels, and this runs in every block
        hit = replace[:, None] & (torch.arange(s, device=self.device)[None] == idx[:, None])
        ops.merge_sinks(kc[:, :s], vc[:, :s], k_new, v_new, hit, shift)

    def finish(self, step: StreamStep) -> None:
        """Advance the bookkeeping of the committing rows after every block has attended."""
        for b, r in enumerate(self._rows):
            if not step.commit[b]:
                continue
            r.frames += step.frames
            r.next_pos += step.frames
            if step.forced_sink[b] >= 0:
                r.sink_pending -= 1


def sink_similarity(k_sinks: torch.Tensor, v_sinks: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
                    ) -> torch.Tensor:
    """How alike each sink is to a new frame: the mean of the cosine similarities of their mean keys
    and of their mean values (means over the tokens, in float32). Sinks [B, s, tokens, H, D], the
    frame [B, tokens, H, D]; returns [B, s]. Pure, so the DiT's compiled ops can fuse it (its
    reductions and small products are a dozen kernels per block eagerly)."""
    f32 = torch.float32
    sim_k = torch.cosine_similarity(
        k_sinks.mean(2, dtype=f32).flatten(2), k_new.mean(1, dtype=f32).flatten(1)[:, None], dim=-1
    )
    sim_v = torch.cosine_similarity(
        v_sinks.mean(2, dtype=f32).flatten(2), v_new.mean(1, dtype=f32).flatten(1)[:, None], dim=-1
    )
    return (sim_k + sim_v) / 2


def merge_sinks(k_sinks: torch.Tensor, v_sinks: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                hit: torch.Tensor, shift: Shift | None = None) -> None:
    """Write the frame's keys and values [B, tokens, H, D] into the sink slots [B, s, tokens, H, D]
    where hit [B, s] is set, in place; with `shift` (cos, sin [B, dt]) the keys' first dt channels of
    each head are first rotated by it (the RoPE time shift to the sink's position). In place so that the
    compiled ops make it one kernel that stores into the cache (a returned merge costs a second pass to
    copy it back), the rotation inside it (no rotated copy of the frame written and read back)."""
    if shift is not None:
        cos, sin = shift
        dt = cos.shape[-1]
        turned = rotate(k_new[..., :dt], cos[:, None, None], sin[:, None, None])
        k_new = torch.cat((turned, k_new[..., dt:]), dim=-1)
    hit = hit[..., None, None, None]
    k_sinks.copy_(torch.where(hit, k_new[:, None], k_sinks))
    v_sinks.copy_(torch.where(hit, v_new[:, None], v_sinks))


@dataclass(frozen=True)
class CacheOps:
    """The cache's tensor functions: eager here, compiled by the DiT's ops (engine/models/wan_dit_ops.py),
    and the attention over the window (`attention`, or `split_attention` with its keys in parts)."""

    rotate: RotateFn = rotate
    sink_similarity: SimilarityFn = sink_similarity
    merge_sinks: MergeFn = merge_sinks
    attend: AttendFn = attention


EAGER_CACHE_OPS = CacheOps()


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Group consecutive slots into (first slot, first chunk frame, count) copy runs."""
    runs: list[tuple[int, int, int]] = []
    for i, s in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, i, 1))
    return runs
