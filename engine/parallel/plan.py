"""Host-side planning of the DiT pipeline: which blocks each rank runs, and the stream's noise.

Block split: contiguous block ranges, one per rank. The split is static for a run: either given
(`parallel.split`), or even, or balanced from measured stage times with `balanced_split` (rank 0
also preprocesses and VAE-encodes, the last rank runs the head and VAE-decodes, so an even split
leaves those two ranks the slowest). Boundaries do not move while streaming.

Noise: the one-GPU `StreamDenoiser` draws every noise tensor of a stream from one generator, in
an order fixed by the sequence of chunks (a chunk's first noise when it enters, then the re-noise
of each row that moves on, row by row). The values never depend on the latents, so rank 0 can
replay that order ahead of time with its own generator seeded the same (`NoiseLedger`) and hand
each draw to the rank that uses it: the pipeline then computes what one GPU computes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def even_split(num_blocks: int, ranks: int) -> list[int]:
    """Blocks per rank, as equal as possible (the extra blocks go to the middle ranks first,
    since rank 0 and the last rank also run the VAE)."""
    if not 1 <= ranks <= num_blocks:
        raise ValueError(f"parallel.gpus: {ranks} ranks cannot share {num_blocks} blocks (1..{num_blocks})")
    base, extra = divmod(num_blocks, ranks)
    order = sorted(range(ranks), key=lambda r: (r in (0, ranks - 1), r))
    return [base + (r in order[:extra]) for r in range(ranks)]


def check_split(split: Sequence[int], num_blocks: int, ranks: int) -> list[int]:
    """`parallel.split` validated against the model (one count per rank, >= 1 each, summing to the blocks)."""
    split = list(split)
    if not split:
        return even_split(num_blocks, ranks)
    if len(split) != ranks or min(split) < 1 or sum(split) != num_blocks:
        raise ValueError(f"parallel.split: {split} must give {ranks} block counts >= 1 that sum to the model's "
                         f"{num_blocks} blocks")
    return split


def stage_ranges(split: Sequence[int]) -> list[range]:
    """Contiguous block ranges from block counts: [2, 2] -> [range(0, 2), range(2, 4)]."""
    out, start = [], 0
    for n in split:
        out.append(range(start, start + n))
        start += n
    return out


def balanced_split(num_blocks: int, block_ms: Sequence[float], fixed_ms: Sequence[float]) -> list[int]:
    """Blocks per rank minimising the slowest stage, from measured times: rank r takes
    `fixed_ms[r] + blocks[r] * block_ms[r]` per tick (fixed: its VAE, pre/postprocess, head).
    Greedy: every rank gets one block, each further block goes where the stage stays fastest
    (optimal for this min-max with per-rank linear costs)."""
    ranks = len(block_ms)
    if len(fixed_ms) != ranks or not 1 <= ranks <= num_blocks:
        raise ValueError(f"need one block time and one fixed time per rank for {num_blocks} blocks")
    blocks = [1] * ranks
    for _ in range(num_blocks - ranks):
        r = min(range(ranks), key=lambda i: fixed_ms[i] + (blocks[i] + 1) * block_ms[i])
        blocks[r] += 1
    return blocks


def suggest_split(ranks: list[dict], chunks: int, num_blocks: int) -> list[int] | None:
    """The block split that would balance the stage times the ranks measured over `chunks`
    chunks (`PipelineSession.stats()["ranks"]`); None before any chunk finished."""
    if chunks == 0:
        return None
    block_ms, fixed_ms = [], []
    for r in ranks:
        stages = {k: v["mean"] * v["count"] / chunks for k, v in r["stages_ms"].items()}
        blocks = r["blocks"][1] - r["blocks"][0]
        dit = stages.pop("dit", 0.0)
        block_ms.append(max(dit / blocks, 1e-6))
        fixed_ms.append(sum(stages.values()))
    return balanced_split(num_blocks, block_ms, fixed_ms)


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
