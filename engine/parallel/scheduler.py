"""The block scheduler: moves DiT block boundaries between pipeline ranks while the stream runs.

A pipeline runs at the pace of its slowest rank. Each rank has fixed work (rank 0: preprocess,
VAE encode and embedding; the last rank: head and VAE decode) and its blocks, whose cost depends
on the GPU, the resolution, the step count and what else shares the machine. So the scheduler
measures rather than assumes: every `dwell` chunks rank 0 asks each rank for its stage seconds
since the last ask (a TIMES message through the ring), models rank r's time per tick as
`fixed[r] + blocks[r] * block[r]` (`rank_costs`), and computes the split that minimises the
slowest rank (`balanced_split`), in which rank 0 and the last rank may hold no block when their
VAE work alone is the slowest stage. When that split would make the slowest rank faster by more
than `threshold` it moves one block across one boundary (`PipelineSession.move_block`), possibly
the last block off an end rank or the first one onto an empty end rank, then measures afresh for
`dwell` chunks before the next decision. Moving one block at a time with a margin and a dwell is
what keeps it from oscillating on noisy measurements: a move back needs the measurements to
show, again by the margin, that the previous split was better. A rank that gave away its last
block is costed with the block time it measured before (not the other ranks'), so a block it ran
slowly is not handed back to it on an estimate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom_live.engine.parallel.plan import balanced_split, min_blocks, rank_costs


class BlockScheduler:
    """Decides block moves from the ranks' measured stage times; see the module docstring."""

    def __init__(self, threshold: float, dwell: int) -> None:
        self.threshold, self.dwell = threshold, dwell
        self.chunks = 0  # since the start or the last move
        self.block_s: dict[int, float] = {}  # each rank's block time when it last held blocks

    def tick(self) -> None:
        self.chunks += 1

    def due(self) -> bool:
        return self.chunks >= self.dwell

    def moved(self) -> None:
        self.chunks = 0

    def decide(self, windows: Sequence[dict[str, Any]], split: Sequence[int]) -> tuple[int, int] | None:
        """(block, destination rank) of the move that pays, or None. `windows[r]`: rank r's
        {"ticks", "seconds": {stage: seconds}} since the last ask (`Stage.take_window`)."""
        if any(w["ticks"] == 0 for w in windows):
            return None
        dit, rest = [], []
        for w in windows:
            per_tick = {k: v / w["ticks"] for k, v in w["seconds"].items()}
            dit.append(per_tick.pop("dit", 0.0))
            rest.append(sum(per_tick.values()))
        block_s, fixed_s = rank_costs(split, dit, rest, [self.block_s.get(r) for r in range(len(split))])
        self.block_s.update({r: b for r, (b, n) in enumerate(zip(block_s, split)) if n})
        self.chunks = 0  # the next decision waits for a fresh window, move or not
        target = balanced_split(sum(split), block_s, fixed_s)
        now = max(f + n * b for f, n, b in zip(fixed_s, split, block_s))
        best = max(f + n * b for f, n, b in zip(fixed_s, target, block_s))
        if now <= 0 or (now - best) / now <= self.threshold:
            return None
        return first_move(split, target)


def first_move(split: Sequence[int], target: Sequence[int]) -> tuple[int, int]:
    """One block across the first boundary where `split` and `target` differ and whose giving rank
    keeps its `min_blocks`, towards `target`: (block, destination rank). Such a boundary exists
    whenever the two differ (both meet the minimums), so a rank in between is never emptied on
    the way, e.g. from [0, 1, 3] to [1, 3, 0]."""
    ranks, have, want = len(split), 0, 0
    for r in range(ranks - 1):
        have += split[r]
        want += target[r]
        if want < have and split[r] > min_blocks(r, ranks):  # rank r gives its last block to rank r + 1
            return have - 1, r + 1
        if want > have and split[r + 1] > min_blocks(r + 1, ranks):  # rank r + 1 gives its first block to rank r
            return have, r
    raise ValueError(f"split {list(split)} is already {list(target)}")
