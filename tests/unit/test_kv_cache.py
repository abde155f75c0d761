"""KV cache bookkeeping: flat memory, bounded positions, refresh, adaptive sinks, row handling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom_live.engine.cache.kv_cache import EAGER_CACHE_OPS, KVCache
from loom_live.engine.layers.rope import rotate
from loom_live.engine.models.wan_dit_ops import BlockOps

HEADS, HEAD_DIM = 1, 12
GRID = (1, 2)  # 2 tokens per latent frame


def make_cache(batch=1, slots=6, sink=3, policy="refresh", refresh_at=50, threshold=-1.0, blocks=(0,)):
    return KVCache.allocate(
        batch,
        GRID,
        HEADS,
        HEAD_DIM,
        blocks,
        num_kv_cache=slots,
        sink=sink,
        rope_policy=policy,
        refresh_at=refresh_at,
        sink_threshold=threshold,
        dtype=torch.float32,
    )


def push(cache, k, v=None, commit=True, q=None, ops=EAGER_CACHE_OPS):
    """One chunk through block 0 of the cache; k/v [B, f, tokens, H, D]."""
    v = k if v is None else v
    f = k.shape[1]
    step = cache.plan(f, commit)
    flat = lambda t: t.flatten(1, 2)  # noqa: E731
    out = cache.attend(step, ops, 0, flat(k if q is None else q), flat(k), flat(v))
    cache.finish(step)
    return out


def rand_chunk(batch=1, f=1):
    return torch.randn(batch, f, GRID[0] * GRID[1], HEADS, HEAD_DIM)


@pytest.mark.parametrize("policy, chunks", [("window", 10_000), ("refresh", 2_000)])
def test_positions_bounded_and_memory_flat_over_long_streams(policy, chunks):
    torch.manual_seed(0)
    cache = make_cache(policy=policy, refresh_at=12)
    storage = [t.data_ptr() for t in (*cache.k.values(), *cache.v.values())]
    memory = cache.memory_bytes()
    chunk = rand_chunk()
    highest = 0
    push(cache, rand_chunk(1, 2))
    for _ in range(chunks):
        push(cache, chunk)
        highest = max(highest, *(p for p in cache.positions[0] if p is not None))
    assert cache.frames == [chunks + 2]
    assert highest == (11 if policy == "refresh" else 5)
    assert cache.memory_bytes() == memory
    assert [t.data_ptr() for t in (*cache.k.values(), *cache.v.values())] == storage


def test_refresh_keeps_sinks_and_makes_ring_contiguous():
    cache = make_cache(slots=6, sink=3, refresh_at=12)
    push(cache, rand_chunk(1, 2))
    seen = []
    for _ in range(30):
        push(cache, rand_chunk())
        seen.append(cache.positions[0])
    assert all(p[:3] == [0, 1, 2] for p in seen)
    for p in seen[3:]:  # once full, ring slots hold consecutive positions starting anywhere >= 3
        assert sorted(p[3:]) == list(range(min(p[3:]), min(p[3:]) + 3))
    seen = seen[3:]
    after = [p for prev, p in zip(seen, seen[1:]) if max(p) < max(prev)]
    assert after, "the stream never refreshed"
    for p in after:  # right after a refresh: sinks 0..2, then the ring 3..5, contiguous
        assert sorted(p) == list(range(6))
    assert cache.next_positions == [max(seen[-1]) + 1]


def test_refresh_rerotates_cached_ring_keys_by_the_shift():
    torch.manual_seed(0)
    cache = make_cache(slots=4, sink=1, refresh_at=8)
    raw = [rand_chunk() for _ in range(9)]
    for r in raw:
        push(cache, r)
    # frames 0..7 sat at positions 0..7; frame 8 would pass refresh_at=8, so the ring frames
    # kept (6, 7) move back to positions 1, 2 (right after the sink) and frame 8 lands at 3.
    expected_slot = {0: (0, 0), 3: (6, 1), 1: (7, 2), 2: (8, 3)}  # slot: (frame, position)
    assert cache.positions[0] == [0, 2, 3, 1]
    for slot, (frame, pos) in expected_slot.items():
        want = rotate(raw[frame][0], *cache.rope.grid(torch.tensor([pos]), *GRID))
        assert torch.allclose(cache.k[0][0, slot], want, atol=1e-5), slot


def test_uncommitted_chunk_leaves_cache_untouched():
    torch.manual_seed(0)
    cache = make_cache(batch=2)
    for _ in range(7):
        push(cache, rand_chunk(2))
    before = cache.copy()
    chunk = rand_chunk(2)
    out_dry = push(cache, chunk, commit=False)
    assert torch.equal(cache.k[0], before.k[0]) and cache.frames == before.frames
    out = push(cache, chunk, commit=True)
    assert torch.equal(out, out_dry)
    assert cache.frames == [8, 8]


def test_masks_hide_empty_slots_per_row():
    """Rows at different fill levels: each attends to exactly its own frames."""
    torch.manual_seed(0)
    cache = make_cache(batch=2, policy="window")
    frames = [rand_chunk(2) for _ in range(3)]
    push(cache, frames[0], commit=[True, False])  # row 1 starts one chunk later
    push(cache, frames[1])
    q = rand_chunk(2)
    out = push(cache, frames[2], q=q, commit=False)
    for row, own in ((0, frames), (1, frames[1:])):
        keys = torch.cat(
            [
                rotate(fr[row], *cache.rope.grid(torch.tensor([i]), *GRID)).flatten(0, 1)
                for i, fr in enumerate(own)
            ]
        )
        vals = torch.cat([fr[row].flatten(0, 1) for fr in own])
        qq = rotate(q[row], *cache.rope.grid(torch.tensor([len(own) - 1]), *GRID)).flatten(0, 1)
        ref = F.scaled_dot_product_attention(qq.transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1))
        assert torch.allclose(out[row], ref.transpose(0, 1), atol=1e-5)


def unit(*coords):
    v = torch.zeros(HEAD_DIM)
    for i, c in enumerate(coords):
        v[i] = c
    return v / v.norm()


def frame_of(vec, batch=1):
    """A chunk whose every token carries `vec` as both key and value."""
    return vec.expand(batch, 1, GRID[0] * GRID[1], HEADS, HEAD_DIM).clone()


@pytest.mark.parametrize(
    "sims, replaced",
    [((0.5, 0.6, 0.62), None), ((0.25, 0.9, 0.3), None), ((0.9, 0.15, 0.3), 1), ((0.19, 0.5, 0.5), 0)],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_adaptive_sink_replaced_only_below_threshold(sims, replaced, compiled):
    """Also through the DiT's compiled cache ops, whose sink merge writes into the cache in place."""
    ops = BlockOps.compiled().cache if compiled else EAGER_CACHE_OPS
    cache = make_cache(sink=3, policy="window", threshold=0.2)
    for axis in range(3):  # sinks along axes 0, 1, 2
        push(cache, frame_of(unit(*([0] * axis + [1]))), ops=ops)
    rest = (1 - sum(s * s for s in sims)) ** 0.5
    new = unit(*sims, rest)  # cosine to sink i is sims[i]
    push(cache, frame_of(new), ops=ops)
    assert torch.equal(cache.v[0][0, :3], cache.k[0][0, :3])  # window policy: keys unrotated, v = k
    sinks = cache.k[0][0, :3, 0, 0]
    for i in range(3):
        expect = new if i == replaced else unit(*([0] * i + [1]))
        assert torch.allclose(sinks[i], expect, atol=1e-6), (i, sinks[i])


def test_a_sink_replaced_while_training_passes_its_gradient():
    cache = make_cache(sink=2, policy="window", threshold=0.2)
    push(cache, frame_of(unit(1)))
    push(cache, frame_of(unit(0, 1)))
    new = frame_of(unit(0, 0, 1)).requires_grad_()  # orthogonal to both sinks: replaces sink 0
    with torch.enable_grad():
        push(cache, new)
        (grad,) = torch.autograd.grad(cache.k[0][0, 0].sum(), new)
    assert torch.allclose(cache.k[0][0, 0, 0, 0], unit(0, 0, 1))
    assert grad.abs().sum() > 0


def test_adaptive_sinks_off_when_threshold_negative():
    cache = make_cache(sink=2, policy="window", threshold=-1)
    push(cache, frame_of(unit(1)))
    push(cache, frame_of(unit(0, 1)))
    push(cache, frame_of(unit(0, 0, 1)))  # orthogonal to both sinks
    assert torch.allclose(cache.k[0][0, :2, 0, 0], torch.stack([unit(1), unit(0, 1)]))


def test_refresh_sinks_replaces_sinks_at_their_positions():
    torch.manual_seed(0)
    cache = make_cache(sink=2, slots=5, policy="refresh", threshold=-1)
    for _ in range(6):
        push(cache, rand_chunk())
    cache.refresh_sinks()
    new = [rand_chunk() for _ in range(3)]
    for n in new:
        push(cache, n)
    for slot in range(2):  # frames after the prompt change, rotated to the sink positions 0 and 1
        expected = rotate(new[slot][0], *cache.rope.grid(torch.tensor([slot]), *GRID))
        assert torch.allclose(cache.k[0][0, slot], expected, atol=1e-5)
    assert cache.positions[0][:2] == [0, 1]


def test_rows_copy_reset_and_to():
    torch.manual_seed(0)
    cache = make_cache(batch=3, blocks=(0, 1))
    for _ in range(4):
        step = cache.plan(1, [True, True, False])
        for b in (0, 1):
            k = rand_chunk(3).flatten(1, 2)
            cache.attend(step, EAGER_CACHE_OPS, b, k, k, k)
        cache.finish(step)
    assert cache.frames == [4, 4, 0]
    view = cache.rows(slice(0, 2))
    assert view.k[1].data_ptr() == cache.k[1].data_ptr() and view.frames == [4, 4]
    picked = cache.rows([2, 0])
    assert picked.frames == [0, 4] and torch.equal(picked.k[0][1], cache.k[0][0])
    twin = cache.copy()
    twin.k[0].add_(1)
    assert not torch.equal(twin.k[0], cache.k[0])
    cache.set_rows([2], cache.rows([0]))
    assert cache.frames == [4, 4, 4] and torch.equal(cache.k[1][2], cache.k[1][0])
    row1 = cache.rows(slice(1, 2))  # a view: its step writes land in place, bookkeeping comes back
    step = row1.plan(1)
    chunk = rand_chunk(1).flatten(1, 2)
    row1.attend(step, EAGER_CACHE_OPS, 0, chunk, chunk, chunk)
    row1.finish(step)
    before = cache.k[0].clone()
    cache.set_rows([1], row1)
    assert cache.frames == [4, 5, 4] and torch.equal(cache.k[0], before) and torch.equal(cache.k[0][1], row1.k[0][0])
    cache.reset([1])
    assert cache.frames == [4, 0, 4] and cache.fill == [4, 0, 4]
    moved = cache.to("cpu")
    assert moved.frames == cache.frames and moved.blocks == [0, 1]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rope_policy"):
        make_cache(policy="yarn")
    with pytest.raises(ValueError, match="sink"):
        make_cache(slots=3, sink=3)
    with pytest.raises(ValueError, match="refresh_at"):
        make_cache(slots=6, refresh_at=6)
    cache = make_cache(slots=4, sink=2)
    push(cache, rand_chunk(1, 2))
    with pytest.raises(ValueError, match="ring"):
        cache.plan(3)


def test_adaptive_sinks_decided_per_row():
    cache = make_cache(batch=3, sink=2, policy="window", threshold=0.2)
    sinks = [unit(1), unit(0, 1)]
    for vec in sinks:
        push(cache, frame_of(vec, 3), commit=[True, True, False])
    new = torch.stack([unit(1, 1), unit(0, 0, 1), unit(0, 0, 1)])  # similar / orthogonal / not started
    push(cache, new[:, None, None, None, :].expand(3, 1, 2, HEADS, HEAD_DIM).clone())
    got = cache.k[0][:, :2, 0, 0]
    assert torch.allclose(got[0], torch.stack(sinks))  # 0.71 similar to both: kept
    assert torch.allclose(got[1, 0], unit(0, 0, 1)) and torch.allclose(got[1, 1], sinks[1])  # replaced
    assert cache.frames == [3, 3, 1] and torch.allclose(
        got[2, 0], unit(0, 0, 1)
    )  # row 2: a plain first frame


def test_blocks_move_between_caches():
    torch.manual_seed(0)
    first, second = make_cache(blocks=(0, 1)), make_cache(blocks=(2,))
    k, v = first.pop_block(1)
    second.put_block(1, k, v)
    assert first.blocks == [0] and second.blocks == [2, 1] and second.k[1] is k
    with pytest.raises(ValueError, match="do not fit"):
        second.put_block(3, k[:, :2], v[:, :2])


def test_static_cross_keeps_its_buffers_for_a_prompt_of_the_same_shape():
    from loom_live.engine.cache.kv_cache import CrossKV
    from loom_live.engine.graphs.dit_steps import StaticCross

    def cross(value: float, tokens: int = 8) -> CrossKV:
        return CrossKV({0: torch.full((1, tokens, 4), value)}, {0: torch.full((1, tokens, 4), -value)})

    static = StaticCross()
    first, reshaped = static.update(cross(1.0))
    assert reshaped
    second, reshaped = static.update(cross(2.0))  # a new prompt: copied into the same buffers
    assert not reshaped and second.k[0] is first.k[0] and float(second.v[0][0, 0, 0]) == -2.0
    third, reshaped = static.update(cross(3.0, tokens=16))  # another shape: new buffers, recapture
    assert reshaped and third.k[0].shape[1] == 16


def test_pinned_sinks_stay_through_refresh_and_adaptation():
    """pin_sinks(1): the first sink (a VACE reference entry) outlives a refresh and similarity swaps,
    in the row that pinned it; the other row's sinks move as before; a reset unpins."""
    torch.manual_seed(1)
    cache = make_cache(batch=2, sink=2, slots=5, threshold=1.5)  # every frame is "dissimilar"
    push(cache, rand_chunk(2, 2))
    cache.pin_sinks(1, rows=[0])
    kept = cache.k[0][:, 0].clone()
    for i in range(6):
        if i == 3:
            cache.refresh_sinks()
        push(cache, rand_chunk(2))
    assert torch.equal(cache.k[0][0, 0], kept[0])
    assert not torch.equal(cache.k[0][1, 0], kept[1])
    cache.reset()
    push(cache, rand_chunk(2, 2))
    fresh = cache.k[0][0, :2].clone()
    for _ in range(3):
        push(cache, rand_chunk(2))
    assert not torch.equal(cache.k[0][0, :2], fresh)  # row 0's sinks adapt again
    with pytest.raises(ValueError, match="pin_sinks"):
        cache.pin_sinks(3)
