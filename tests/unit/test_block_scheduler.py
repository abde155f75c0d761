"""The block scheduler's decisions: move only when it pays by the margin, one block at a time,
towards the split that balances the measured stage times, and not again before a fresh window."""

from __future__ import annotations

import pytest

from loom_live.engine.parallel.plan import stage_ranges
from loom_live.engine.parallel.scheduler import BlockScheduler, first_move


def window(rank: int, ticks: int, dit: float, **fixed: float) -> dict:
    return {"rank": rank, "ticks": ticks, "seconds": {"dit": dit, **fixed}}


def test_an_unbalanced_pipeline_moves_one_block_towards_the_slow_ranks_relief():
    s = BlockScheduler(threshold=0.1, dwell=4)
    # 1 ms per block on both ranks; rank 1 also decodes for 10 ms a tick: 15 blocks each -> 15 vs 25 ms
    windows = [window(0, 10, 0.150), window(1, 10, 0.150, decode=0.100)]
    assert s.decide(windows, [15, 15]) == (15, 0)  # rank 1 gives its first block to rank 0


def test_a_slow_first_rank_gives_its_last_block():
    s = BlockScheduler(threshold=0.1, dwell=4)
    windows = [window(0, 10, 0.150, encode=0.100), window(1, 10, 0.150)]
    assert s.decide(windows, [15, 15]) == (14, 1)


def test_below_the_margin_nothing_moves():
    s = BlockScheduler(threshold=0.2, dwell=4)
    # the best split is about 10% faster: inside the 20% margin, so the split stays (no flapping on noise)
    windows = [window(0, 10, 0.150), window(1, 10, 0.150, decode=0.030)]
    assert s.decide(windows, [15, 15]) is None


def test_a_balanced_split_stays():
    s = BlockScheduler(threshold=0.0, dwell=4)
    windows = [window(0, 10, 0.200), window(1, 10, 0.100, decode=0.100)]
    assert s.decide(windows, [20, 10]) is None


def test_dwell_counts_chunks_since_the_last_decision():
    s = BlockScheduler(threshold=0.1, dwell=3)
    for _ in range(2):
        s.tick()
    assert not s.due()
    s.tick()
    assert s.due()
    s.decide([window(0, 5, 0.1), window(1, 5, 0.1)], [2, 2])
    assert not s.due()  # a decision, move or not, waits for a fresh window
    for _ in range(3):
        s.tick()
    s.moved()
    assert not s.due()


def test_no_decision_without_measurements_on_every_rank():
    s = BlockScheduler(threshold=0.0, dwell=1)
    assert s.decide([window(0, 0, 0.0), window(1, 5, 0.1, decode=1.0)], [2, 2]) is None


def test_first_move_over_three_ranks():
    assert first_move([10, 10, 10], [10, 12, 8]) == (20, 1)  # rank 2 gives its first block to rank 1
    assert first_move([10, 10, 10], [9, 11, 10]) == (9, 1)  # rank 0 gives its last block to rank 1
    with pytest.raises(ValueError):
        first_move([2, 2], [2, 2])


def test_a_slow_encoder_gives_its_last_block_and_becomes_vae_only():
    # 1 ms per block; rank 0 encodes for 10 ms a tick: [1, 3] -> 11 vs 3 ms, [0, 4] -> 10 vs 4 ms (9% faster)
    windows = [window(0, 10, 0.010, encode=0.100), window(1, 10, 0.030)]
    assert BlockScheduler(threshold=0.05, dwell=4).decide(windows, [1, 3]) == (0, 1)
    assert BlockScheduler(threshold=0.1, dwell=4).decide(windows, [1, 3]) is None  # inside the margin


def test_an_empty_end_rank_takes_a_block_back_when_the_others_slow_down():
    # rank 0 only encodes (1 ms) and spent a little in its empty block stage; rank 1 runs 4 blocks of
    # 2 ms and decodes for 1 ms: 9 ms. The empty rank is costed at 2 ms a block, so blocks go back to it.
    windows = [window(0, 10, 0.001, encode=0.010), window(1, 10, 0.080, decode=0.010)]
    assert BlockScheduler(threshold=0.1, dwell=4).decide(windows, [0, 4]) == (0, 0)
    # once the end rank's VAE is the slowest stage by itself, an empty rank stays empty
    windows = [window(0, 10, 0.001, encode=0.100), window(1, 10, 0.080, decode=0.010)]
    assert BlockScheduler(threshold=0.0, dwell=4).decide(windows, [0, 4]) is None


def measured(split: list[int], block_s: float, fixed: list[dict[str, float]]) -> list[dict]:
    """The windows a split gives over 10 ticks: `block_s` per block, `fixed[r]` per tick on rank r."""
    return [window(r, 10, 10 * n * block_s, **{k: 10 * v for k, v in f.items()})
            for r, (n, f) in enumerate(zip(split, fixed))]


def converge(threshold: float, split: list[int], fixed: list[dict[str, float]]) -> list[int]:
    """Decide and move, with the windows each split gives (1 ms per block), until nothing pays."""
    s = BlockScheduler(threshold=threshold, dwell=4)
    for _ in range(20):
        move = s.decide(measured(split, 0.001, fixed), split)
        if move is None:
            return split
        block, dst = move
        src = next(r for r, rng in enumerate(stage_ranges(split)) if block in rng)
        split = [n - (r == src) + (r == dst) for r, n in enumerate(split)]
        assert min(split[1:-1]) >= 1
    raise AssertionError(f"no rest after 20 moves: {split}")


def test_the_scheduler_makes_the_last_rank_decode_only_and_stays():
    # rank 0 encodes for 10 ms, the last rank decodes for 40 ms a tick: its blocks all go
    fixed = [{"encode": 0.010}, {}, {"decode": 0.040}]
    assert converge(0.02, [5, 5, 5], fixed)[2] == 0  # [encode + blocks] [blocks] [decode]
    # with a 5% margin it rests once the decoder's last blocks would gain less than that (2 of 42 ms)
    assert converge(0.05, [5, 5, 5], fixed)[2] == 2
    # DiT-heavy (the VAE is 1 ms each side): every rank keeps blocks
    assert min(converge(0.02, [2, 11, 2], [{"encode": 0.001}, {}, {"decode": 0.001}])) > 0


def test_first_move_never_empties_a_middle_rank():
    assert first_move([0, 1, 3], [1, 3, 0]) == (1, 1)  # not block 0 off rank 1 first: rank 2 gives block 1
    assert first_move([1, 3], [0, 4]) == (0, 1)  # the last block off rank 0
    assert first_move([0, 4, 0], [1, 3, 0]) == (0, 0)  # onto an empty rank 0
    assert first_move([1, 3, 0], [1, 2, 1]) == (3, 2)  # onto an empty last rank


def test_a_rank_that_ran_its_block_slowly_does_not_get_it_back_on_an_estimate():
    s = BlockScheduler(threshold=0.05, dwell=4)
    # rank 0: encode 10 ms + its block at 3 ms; rank 1: 3 blocks of 1 ms + decode 8 ms -> 13 vs 11 ms
    assert s.decide([window(0, 10, 0.030, encode=0.100), window(1, 10, 0.030, decode=0.080)], [1, 3]) == (0, 1)
    # [0, 4]: 10 vs 12 ms. At the others' 1 ms a block, [1, 3] would look faster (11 vs 11 ms) and the
    # block would go back and forth; rank 0's own 3 ms say it would not (13 ms)
    at_empty = [window(0, 10, 0.0, encode=0.100), window(1, 10, 0.040, decode=0.080)]
    assert s.decide(at_empty, [0, 4]) is None
    assert BlockScheduler(threshold=0.05, dwell=4).decide(at_empty, [0, 4]) == (0, 0)  # no history: the estimate
