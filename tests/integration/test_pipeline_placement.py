"""VAE-only pipeline ranks: rank 0 or the last rank holding no DiT block, on CPU ranks (gloo).

Oracle: the one-process StreamSession on the same frames, seed, LoRA and live script (a LoRA
scale and the sink threshold, then a step change). A rank without blocks still plans every
micro-batch on its blockless cache and passes on the ring's messages (tokens, returning rows,
decoded pixels, live settings, block moves); a live move empties or refills it between two
ticks, and the frames stay those of one process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.parallel.plan import check_move
from loom_live.engine.parallel.scheduler import BlockScheduler
from loom_live.engine.parallel.session import PipelineSession
from loom_live.engine.stream.session import StreamSession
from tests.integration.test_pipeline_live import assert_same_frames, script, style_lora
from tests.integration.test_pipeline_parallel import clip, no_children_left


@pytest.fixture(scope="module")
def styled(tmp_path_factory) -> list[str]:
    return style_lora(tmp_path_factory.mktemp("lora"))


CUTS = [0, 9, 13, 17, 21]  # four parts: 2 chunks (the first has 5 frames), then 1 chunk each


def live(session, between) -> np.ndarray:
    """Push the clip in four parts; `between(i)` runs after part i (the script, moves)."""
    frames, outs = clip(CUTS[-1]), []
    for i in range(4):
        outs.append(session.push(frames[CUTS[i]:CUTS[i + 1]]))
        between(i)
    outs.append(session.flush())
    return np.concatenate([o for o in outs if len(o)])


@pytest.fixture(scope="module")
def reference(styled) -> np.ndarray:
    one = StreamSession.from_config(load_config("tiny-random", styled))
    return live(one, lambda i: script(one, i))


def moving(pipe: PipelineSession, moves: dict[int, list[tuple[int, int]]]) -> tuple[np.ndarray, list[list[int]]]:
    """The live script with block moves after it (after part i: `moves[i]`); returns the frames and
    the split after each part."""
    splits = []

    def between(i: int) -> None:
        script(pipe, i)
        for block, dst in moves.get(i, []):
            pipe.move_block(block, dst)
        splits.append(list(pipe.split))
    return live(pipe, between), splits


class Watching(BlockScheduler):
    """The live scheduler's measuring path and its real decisions, over windows that include a
    blockless rank, without acting on them (CPU timings would make the moves vary by run)."""

    def __init__(self) -> None:
        super().__init__(threshold=0.0, dwell=1)
        self.decisions: list[tuple[list[int], tuple[int, int] | None]] = []

    def decide(self, windows, split):
        self.decisions.append((list(split), super().decide(windows, split)))
        return None


def test_two_ranks_run_an_encode_only_rank_0_then_a_decode_only_last_rank(styled, reference):
    cfg = load_config("tiny-random", [*styled, "parallel.gpus=2", "parallel.split=[0,4]"])
    with PipelineSession(cfg) as pipe:
        pipe.scheduler = Watching()
        start = pipe.stats()["placement"]
        # refill rank 0, then empty the last rank block by block, then refill it
        out, splits = moving(pipe, {0: [(0, 0)], 1: [(1, 0), (2, 0), (3, 0)], 2: [(3, 1)]})
        stats = pipe.stats()
    assert start == ["encode", "blocks 0-3 + decode"]
    assert splits == [[1, 3], [4, 0], [3, 1], [3, 1]]
    assert_same_frames(out, reference)
    assert stats["placement"] == ["encode + blocks 0-2", "blocks 3-3 + decode"]
    assert stats["lora_scales"] == {"style": 0.5} and stats["steps"] == [700, 500]
    decisions = pipe.scheduler.decisions
    assert decisions  # windows came back from every rank, a blockless one included
    for split, move in decisions:  # a decision, if any, is a move the placement allows
        if move is not None:
            check_move(split, *move)
    assert no_children_left()


def test_three_ranks_with_vae_only_ends_fill_and_empty_them_live(styled, reference):
    cfg = load_config("tiny-random", [*styled, "parallel.gpus=3", "parallel.split=[0,4,0]",
                                      "parallel.rebalance=false"])
    with PipelineSession(cfg) as pipe:
        # the LoRA scale meets two blockless ranks, the step change a blockless last rank
        out, splits = moving(pipe, {0: [(0, 0)], 1: [(3, 2)], 2: [(3, 1), (0, 1)]})
        stats = pipe.stats()
    assert splits == [[1, 3, 0], [1, 2, 1], [0, 4, 0], [0, 4, 0]]
    assert_same_frames(out, reference)
    assert stats["placement"] == ["encode", "blocks 0-3", "decode"] and stats["block_moves"] == 4
    ranks = sorted(stats["ranks"], key=lambda r: r["rank"])
    assert [r["blocks"] for r in ranks] == [[0, 0], [0, 4], [4, 4]]
    assert {"encode", "embed"} <= set(ranks[0]["stages_ms"]) and "decode" in ranks[2]["stages_ms"]
    assert no_children_left()


def test_bad_splits_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"rank 1 would run no blocks \(only rank 0 and the last rank may\)"):
        PipelineSession(load_config("tiny-random", ["parallel.gpus=3", "parallel.split=[2,0,2]"]))
    with pytest.raises(ValueError, match="3 blocks in all, the model has 4"):
        PipelineSession(load_config("tiny-random", ["parallel.gpus=2", "parallel.split=[0,3]"]))
    assert no_children_left()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_with_a_vae_only_rank_give_the_one_gpu_frames(styled):
    """Over NCCL, with CUDA graphs: a blockless stage runs eagerly, and graphs are captured afresh
    once a block arrives."""
    overrides = [*styled, "model.device=cuda"]
    one = StreamSession.from_config(load_config("tiny-random", overrides), warmup=False)
    reference = live(one, lambda i: script(one, i))
    cfg = load_config("tiny-random", [*overrides, "parallel.gpus=2", "parallel.split=[0,4]",
                                      "parallel.rebalance=false"])
    with PipelineSession(cfg) as pipe:
        out, splits = moving(pipe, {0: [(0, 0)], 1: [(1, 0), (2, 0), (3, 0)], 2: [(3, 1)]})
    assert splits == [[1, 3], [4, 0], [3, 1], [3, 1]]
    diff = np.abs(out.astype(int) - reference.astype(int))
    assert out.shape == reference.shape and diff.max() <= 2 and (diff > 0).mean() < 1e-2
    assert no_children_left()
