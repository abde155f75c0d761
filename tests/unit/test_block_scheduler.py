"""The block scheduler's decisions: move only when it pays by the margin, one block at a time,
towards the split that balances the measured stage times, and not again before a fresh window."""

from __future__ import annotations

import pytest

from engine.parallel.scheduler import BlockScheduler, first_move


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
