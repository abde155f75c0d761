"""Host-side planning of the pipeline: what each rank runs (the placement), and the stream's noise.

Placement: frames enter at rank 0 (preprocess, VAE encode, patch and time embedding) and leave
at the last rank (head, scheduler step, VAE decode); between them the DiT's blocks are cut into
contiguous ranges, one per rank (the split, blocks per rank). The VAE is a large share of the
work (the full Wan VAE more than the DiT at one step), so the two ends may hold no block at all:
with 4 GPUs [encode] [blocks] [blocks] [decode] can be the fastest placement, with 3 [encode +
blocks] [blocks] [decode]. The ranks in between exist only to run blocks and hold at least one
(`min_blocks`). A run starts from the given split (`parallel.split`) or an even one;
`balanced_split` computes the split that minimises the slowest stage from measured times, which
the block scheduler (`engine/parallel/scheduler.py`) moves towards while streaming.

Noise: the one-GPU `StreamDenoiser` draws every noise tensor of a stream from one generator, in
an order fixed by the sequence of chunks (a chunk's first noise when it enters, then the re-noise
of each row that moves on, row by row). The values never depend on the latents, so rank 0 can
replay that order ahead of time with its own generator seeded the same (`NoiseLedger`) and hand
each draw to the rank that uses it: the pipeline then computes what one GPU computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def min_blocks(rank: int, ranks: int) -> int:
    """The fewest blocks rank `rank` of `ranks` holds: rank 0 (encode) and the last rank (decode)
    have work of their own and may hold none; a rank in between has nothing else to do."""
    return 0 if rank in (0, ranks - 1) else 1


@dataclass(frozen=True)
class RankWork:
    """What one rank runs per tick: the VAE encode (frames enter), a block range, the VAE decode."""

    encode: bool
    blocks: range
    decode: bool

    def __str__(self) -> str:
        parts = ["encode"] if self.encode else []
        if self.blocks:
            parts.append(f"blocks {self.blocks.start}-{self.blocks.stop - 1}")
        if self.decode:
            parts.append("decode")
        return " + ".join(parts)


def placement(split: Sequence[int]) -> list[RankWork]:
    """Each rank's work for a split: encode on rank 0, decode on the last rank, blocks in order."""
    last = len(split) - 1
    return [RankWork(r == 0, blocks, r == last) for r, blocks in enumerate(stage_ranges(split))]


def even_split(num_blocks: int, ranks: int) -> list[int]:
    """Blocks per rank, as equal as possible (the extra blocks go to the middle ranks first,
    since rank 0 and the last rank also run the VAE)."""
    if not 1 <= ranks <= num_blocks:
        raise ValueError(f"parallel.gpus: {ranks} ranks cannot share {num_blocks} blocks evenly (1..{num_blocks}); "
                         "more ranks need a parallel.split with 0 blocks on rank 0 or the last rank (or both)")
    base, extra = divmod(num_blocks, ranks)
    order = sorted(range(ranks), key=lambda r: (r in (0, ranks - 1), r))
    return [base + (r in order[:extra]) for r in range(ranks)]


def check_split(split: Sequence[int], num_blocks: int, ranks: int) -> list[int]:
    """`parallel.split` validated against the model and the ranks (empty: the even split)."""
    split = list(split)
    if not split:
        return even_split(num_blocks, ranks)
    if len(split) != ranks:
        problem = f"{len(split)} entries for {ranks} GPUs"
    elif min(split) < 0:
        problem = "a negative block count"
    elif any(n < min_blocks(r, ranks) for r, n in enumerate(split)):
        empty = [r for r, n in enumerate(split) if n < min_blocks(r, ranks)]
        problem = f"rank {', '.join(map(str, empty))} would run no blocks (only rank 0 and the last rank may)"
    elif sum(split) != num_blocks:
        problem = f"{sum(split)} blocks in all, the model has {num_blocks}"
    else:
        return split
    middle = f", >= 1 on ranks 1..{ranks - 2}" if ranks > 2 else ""
    raise ValueError(f"parallel.split: {split}: {problem}; allowed: one block count per GPU summing to "
                     f"{num_blocks}, >= 0 on rank 0 and rank {ranks - 1} (they also encode and decode){middle}")


def check_move(split: Sequence[int], block: int, dst: int) -> int:
    """The rank that holds `block`, once checked that it may give it to rank `dst`: a neighbour,
    the end block of its range that faces `dst`, and it keeps `min_blocks` after."""
    ranks, ranges = len(split), stage_ranges(split)
    src = next((r for r, rng in enumerate(ranges) if block in rng), None)
    if src is None:
        raise ValueError(f"block {block}: the model has blocks 0-{sum(split) - 1}")
    if abs(dst - src) != 1 or not 0 <= dst < ranks:
        near = " or ".join(str(r) for r in (src - 1, src + 1) if 0 <= r < ranks)
        raise ValueError(f"block {block} is on rank {src}: it can move to rank {near}, not {dst}")
    edge = ranges[src].stop - 1 if dst > src else ranges[src].start
    if block != edge:
        raise ValueError(f"block {block}: rank {src} ({placement(split)[src]}) can give rank {dst} only its "
                         f"{'last' if dst > src else 'first'} block ({edge})")
    if len(ranges[src]) <= min_blocks(src, ranks):
        raise ValueError(f"block {block}: rank {src} keeps its only block (only rank 0 and the last rank may run "
                         "no blocks)")
    return src


def stage_ranges(split: Sequence[int]) -> list[range]:
    """Contiguous block ranges from block counts: [2, 2] -> [range(0, 2), range(2, 4)]; an empty
    range sits where the blocks of its neighbours meet ([0, 4] -> [range(0, 0), range(0, 4)])."""
    out, start = [], 0
    for n in split:
        out.append(range(start, start + n))
        start += n
    return out


def rank_costs(split: Sequence[int], dit: Sequence[float], rest: Sequence[float],
               earlier: Sequence[float | None] | None = None) -> tuple[list[float], list[float]]:
    """Per rank (time per block, fixed time per tick), from what each rank measured per tick in its
    blocks (`dit`) and in the rest of its work (`rest`: pre/postprocess, encode, embed, head,
    decode). A rank without blocks measured no block time now: it is taken as the one it measured
    when it last had blocks (`earlier[r]`), or else as the mean block time of the ranks with blocks
    (the GPUs of one node are alike; a move corrects it with a measurement). The bookkeeping it did
    in its empty block stage counts as fixed."""
    mean = sum(d for d, n in zip(dit, split) if n) / sum(split)
    earlier = earlier or [None] * len(split)
    block = [max(d / n if n else earlier[r] or mean, 1e-9) for r, (d, n) in enumerate(zip(dit, split))]
    fixed = [f + (0.0 if n else d) for f, d, n in zip(rest, dit, split)]
    return block, fixed


def balanced_split(num_blocks: int, block_ms: Sequence[float], fixed_ms: Sequence[float]) -> list[int]:
    """Blocks per rank minimising the slowest stage, from measured times: rank r takes
    `fixed_ms[r] + blocks[r] * block_ms[r]` per tick (fixed: its VAE, pre/postprocess, embedding,
    head). Greedy: every rank starts at `min_blocks` (none at the two ends), each further block
    goes where the stage stays fastest (optimal for this min-max with per-rank linear costs), so
    an end whose VAE alone is the slowest stage gets no block."""
    ranks = len(block_ms)
    if len(fixed_ms) != ranks or ranks < 1:
        raise ValueError(f"need one block time and one fixed time per rank, got {ranks} and {len(fixed_ms)}")
    blocks = [min_blocks(r, ranks) for r in range(ranks)]
    if sum(blocks) > num_blocks:
        raise ValueError(f"{ranks} ranks need at least {sum(blocks)} blocks; the model has {num_blocks}")
    for _ in range(num_blocks - sum(blocks)):
        r = min(range(ranks), key=lambda i: fixed_ms[i] + (blocks[i] + 1) * block_ms[i])
        blocks[r] += 1
    return blocks


def suggest_split(ranks: list[dict], chunks: int, num_blocks: int) -> list[int] | None:
    """The block split that would balance the stage times the ranks measured over `chunks`
    chunks (`PipelineSession.stats()["ranks"]`); None before any chunk finished."""
    if chunks == 0:
        return None
    split, dit, rest = [], [], []
    for r in ranks:
        stages = {k: v["mean"] * v["count"] / chunks for k, v in r["stages_ms"].items()}
        split.append(r["blocks"][1] - r["blocks"][0])
        dit.append(stages.pop("dit", 0.0))
        rest.append(sum(stages.values()))
    return balanced_split(num_blocks, *rank_costs(split, dit, rest))


class NoiseLedger:
    """Replays the one-GPU denoiser's noise draws, in its order, and keeps them until used.

    `take(chunk, step)` returns the noise that puts chunk `chunk` at step `step`: step 0 is the
    chunk's first noise, step i > 0 the re-noise after step i - 1. Mirrors `StreamDenoiser`:
    `sequential` is `run_sequential`, `batch` is one `push_batch` (None: a drain forward).
    """

    def __init__(self, steps: int, generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> None:
        self.n = steps
        self.generator, self.device, self.dtype = generator, device, dtype
        self.rows: list[tuple[int, tuple[int, ...]] | None] = [None] * steps
        self._drawn: dict[tuple[int, int], torch.Tensor] = {}

    def _draw(self, chunk: int, step: int, shape: tuple[int, ...]) -> None:
        noise = torch.randn(shape, generator=self.generator, device=self.device, dtype=torch.float32)
        self._drawn[(chunk, step)] = noise.to(self.dtype)

    def sequential(self, chunk: int, shape: tuple[int, ...]) -> None:
        if any(self.rows):
            raise RuntimeError("drain the stream-batch rows before a sequential chunk")
        for step in range(self.n):
            self._draw(chunk, step, shape)

    def batch(self, chunk: int | None, shape: tuple[int, ...] | None = None) -> None:
        if chunk is not None:
            if self.rows[0] is not None:
                raise RuntimeError("row 0 is occupied")
            self._draw(chunk, 0, shape)
            self.rows[0] = (chunk, shape)
        moved: list[tuple[int, tuple[int, ...]] | None] = [None] * self.n
        for i, row in enumerate(self.rows):
            if row is not None and i < self.n - 1:
                self._draw(row[0], i + 1, row[1])
                moved[i + 1] = row
        self.rows = moved

    def drain(self) -> None:
        while any(self.rows):
            self.batch(None)

    def take(self, chunk: int, step: int) -> torch.Tensor:
        return self._drawn.pop((chunk, step))

    def reset(self, generator: torch.Generator) -> None:
        self.generator = generator
        self.rows = [None] * self.n
        self._drawn.clear()
