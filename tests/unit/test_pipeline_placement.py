"""Placement of the pipeline's work over ranks: which splits are allowed (VAE-only end ranks),
which one the planner picks from measured times, which block moves are allowed, and the
blockless KV cache a VAE-only rank keeps so that a block can arrive at any tick."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.cache.kv_cache import KVCache
from loom_live.engine.parallel.plan import (
    balanced_split,
    check_move,
    check_split,
    placement,
    rank_costs,
    stage_ranges,
    suggest_split,
)

# one H200, Wan2.1-1.3B at one step: VAE encode ~25 ms, decode ~37 ms, 30 blocks ~24 ms per chunk
ENCODE, DECODE, BLOCK = 25.0, 37.0, 0.8


def fixed(ranks: int) -> list[float]:
    return [ENCODE] + [0.0] * (ranks - 2) + [DECODE]


def test_a_vae_heavy_pipeline_gets_vae_only_end_ranks():
    assert balanced_split(30, [BLOCK] * 4, fixed(4)) == [0, 15, 15, 0]  # [encode] [blocks] [blocks] [decode]
    three = balanced_split(30, [BLOCK] * 3, fixed(3))
    assert three[2] == 0 and three[1] > 0  # the decoder alone is the slowest stage: it takes no block
    assert max(f + n * BLOCK for f, n in zip(fixed(3), three)) == DECODE
    # two GPUs: the decoder alone outweighs the encoder and every block
    assert balanced_split(4, [1.0, 1.0], [5.0, 60.0]) == [4, 0]


def test_a_dit_heavy_pipeline_keeps_blocks_on_every_rank():
    # a large DiT (40 blocks of 5 ms) next to the same VAE: every rank's blocks are needed
    split = balanced_split(40, [5.0] * 4, fixed(4))
    assert min(split) > 0 and sum(split) == 40
    assert split[0] < split[1] and split[3] < split[2]  # the VAE ranks take fewer


def test_a_blockless_rank_is_costed_with_the_other_ranks_block_time():
    block, fix = rank_costs([0, 4, 0], [0.1, 8.0, 0.2], [25.0, 0.0, 37.0])
    assert block == [2.0, 2.0, 2.0]
    assert fix == [25.1, 0.0, 37.2]  # its bookkeeping in the empty block stage is fixed work


def test_the_suggested_split_from_stats_can_empty_an_end_rank():
    ranks = [{"blocks": [0, 2], "stages_ms": {"encode": {"mean": 1.0, "count": 10}, "dit": {"mean": 2.0, "count": 10}}},
             {"blocks": [2, 4], "stages_ms": {"dit": {"mean": 2.0, "count": 10}, "decode": {"mean": 9.0, "count": 10}}}]
    assert suggest_split(ranks, 10, 4) == [4, 0]


def test_splits_with_empty_ends_are_allowed_and_others_refused_by_name():
    assert check_split([0, 4], 4, 2) == [0, 4]
    assert check_split([0, 4, 0], 4, 3) == [0, 4, 0]
    assert check_split([], 4, 2) == [2, 2]
    with pytest.raises(ValueError, match=r"parallel.split: \[2, 0, 2\]: rank 1 would run no blocks .*only rank 0 "
                                         r"and the last rank may.*>= 1 on ranks 1..1"):
        check_split([2, 0, 2], 4, 3)
    with pytest.raises(ValueError, match=r"3 blocks in all, the model has 4; allowed: one block count per GPU "
                                         r"summing to 4, >= 0 on rank 0 and rank 1"):
        check_split([0, 3], 4, 2)
    with pytest.raises(ValueError, match="3 entries for 2 GPUs"):
        check_split([1, 1, 2], 4, 2)
    with pytest.raises(ValueError, match="a negative block count"):
        check_split([-1, 5], 4, 2)
    with pytest.raises(ValueError, match="parallel.gpus: 5 ranks cannot share 4 blocks evenly"):
        check_split([], 4, 5)
    assert check_split([0, 1, 1, 1, 1], 4, 5) == [0, 1, 1, 1, 1]  # more GPUs than blocks: the ends run the VAE


def test_placement_names_each_ranks_work():
    assert [str(w) for w in placement([0, 15, 15, 0])] == ["encode", "blocks 0-14", "blocks 15-29", "decode"]
    assert [str(w) for w in placement([3, 1])] == ["encode + blocks 0-2", "blocks 3-3 + decode"]
    assert [list(r) for r in stage_ranges([0, 4, 0])] == [[], [0, 1, 2, 3], []]
    assert stage_ranges([0, 4])[0] == range(0, 0) and stage_ranges([4, 0])[1] == range(4, 4)


def test_moves_may_empty_and_refill_the_end_ranks_only():
    assert check_move([1, 3], 0, 1) == 0  # rank 0 gives its only block: it keeps encoding
    assert check_move([0, 4], 0, 0) == 1  # and takes one back
    assert check_move([3, 1], 3, 0) == 1  # the last rank gives its only block
    assert check_move([0, 4, 0], 3, 2) == 1  # an empty last rank takes one
    with pytest.raises(ValueError, match="rank 1 keeps its only block"):
        check_move([1, 1, 2], 1, 2)
    with pytest.raises(ValueError, match=r"rank 0 \(encode \+ blocks 0-2\) can give rank 1 only its last block \(2\)"):
        check_move([3, 1], 0, 1)
    with pytest.raises(ValueError, match="block 3 is on rank 1: it can move to rank 0, not 2"):
        check_move([0, 4], 3, 2)
    with pytest.raises(ValueError, match="the model has blocks 0-3"):
        check_move([0, 4], 4, 0)


def test_a_blockless_cache_keeps_the_bookkeeping_and_takes_a_block():
    kw = dict(batch=2, token_grid=(2, 2), heads=2, head_dim=8, num_kv_cache=4, sink=1, refresh_at=6)
    held = KVCache.allocate(blocks=[0], **kw)
    empty = KVCache.allocate(blocks=[], **kw)
    assert empty.block_shape == held.block_shape and empty.blocks == []
    for frames in [2, 1, 1, 1, 1, 1, 1]:  # past the ring's wrap and a RoPE refresh
        for cache in (held, empty):
            cache.finish(cache.plan(frames))
    assert empty.frames == held.frames and empty.positions == held.positions
    rows = empty.rows([1, 0])  # a step change maps rows
    assert rows.block_shape == empty.block_shape and rows.frames == empty.frames
    k, v = held.pop_block(0)
    empty.put_block(0, k, v)
    assert empty.blocks == [0] and torch.equal(empty.k[0], k)
    with pytest.raises(ValueError, match="do not fit"):
        empty.put_block(1, k[:1], v[:1])
