"""Streaming forward: equals the block-causal full forward while the stream fits the window,
and equals an independent recompute-over-retained-frames reference once frames are evicted."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.layers.attention import attention
from loom_live.engine.layers.rope import rotate
from loom_live.engine.models.wan_dit import WanDiT, WanDiTConfig

CFG = WanDiTConfig(dim=48, ffn_dim=64, num_heads=2, num_layers=2, text_dim=32, text_len=16, freq_dim=32)
H, W = 4, 6  # latent frame -> 2x3 tokens


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = WanDiT(CFG).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m


@pytest.fixture(autouse=True)
def no_grad():
    """Inference only (conftest already pins torch to one thread)."""
    with torch.no_grad():
        yield


class RetainedFramesReference:
    """One stream, written without slots or rings: every committed frame's raw K/V per block is
    kept in a list with its position, and each chunk recomputes attention (torch.cat, no mask)
    over exactly the frames the window retains: the first `sink` frames, then the newest ring
    frames that still fit beside the chunk. Positions follow the policy's definition."""

    def __init__(self, model: WanDiT, slots: int, sink: int, policy: str, refresh_at: int = 50):
        self.model, self.slots, self.sink, self.policy, self.refresh_at = (
            model,
            slots,
            sink,
            policy,
            refresh_at,
        )
        self.frames: list[dict] = []
        self.next_pos = 0
        self.rope = model.rope(torch.device("cpu"))

    def chunk(self, x: torch.Tensor, t: torch.Tensor, cross) -> torch.Tensor:
        f, ring_size = x.shape[2], self.slots - self.sink
        into_sinks = max(0, min(f, self.sink - len(self.frames)))
        ring = self.frames[self.sink :]
        room = ring_size - (f - into_sinks)
        kept = ring[len(ring) - min(len(ring), room) :] if room > 0 else []
        retained = self.frames[: self.sink] + kept
        if self.policy == "window":
            positions = list(range(len(retained)))
            chunk_pos = list(range(len(retained), len(retained) + f))
        else:
            if self.next_pos + f > self.refresh_at:
                shift = self.next_pos - len(kept) - self.sink
                for fr in ring:
                    fr["pos"] -= shift
                self.next_pos -= shift
            positions = [fr["pos"] for fr in retained]
            chunk_pos = list(range(self.next_pos, self.next_pos + f))
        grid = lambda ps: self.rope.grid(torch.tensor(ps), H // 2, W // 2)  # noqa: E731
        new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def attend(block, q, k, v):
            keys = [rotate(fr["kv"][block][0], *grid([p])) for fr, p in zip(retained, positions)]
            vals = [fr["kv"][block][1] for fr in retained]
            keys.append(rotate(k, *grid(chunk_pos)))
            vals.append(v)
            new[block] = (k, v)
            return attention(rotate(q, *grid(chunk_pos)), torch.cat(keys, 1), torch.cat(vals, 1))

        tokens, cond, g = self.model.embed(x, t)
        tokens = self.model.run_blocks(0, CFG.num_layers, tokens, cond, cross, attend)
        per_frame = g[1] * g[2]
        for j in range(f):
            kv = {
                b: (k[:, j * per_frame : (j + 1) * per_frame], v[:, j * per_frame : (j + 1) * per_frame])
                for b, (k, v) in new.items()
            }
            self.frames.append({"kv": kv, "pos": self.next_pos + j})
        self.next_pos += f
        return self.model.head(tokens, cond, g)


def stream_inputs(batch: int, frames: int, seed: int = 1):
    torch.manual_seed(seed)
    return torch.randn(batch, 16, frames, H, W), torch.randn(batch, CFG.text_len, CFG.text_dim)


@pytest.mark.parametrize("policy", ["refresh", "window"])
@pytest.mark.parametrize("chunks", [[1, 1, 1, 1, 1, 1], [2, 2, 2], [2, 1, 1, 1, 1]])
def test_stream_equals_block_causal_forward_while_it_fits(model, policy, chunks):
    x, ctx = stream_inputs(2, sum(chunks))
    steps = torch.tensor([[900.0], [300.0]]) - 40.0 * torch.arange(len(chunks))
    cache = model.new_cache(2, (H, W), num_kv_cache=6, sink=3, rope_policy=policy, sink_threshold=-1)
    cross = model.cross_kv(ctx)
    outs, start = [], 0
    for i, f in enumerate(chunks):
        outs.append(model.forward_stream(x[:, :, start : start + f], steps[:, i], cache, cross))
        start += f
    per_frame_t = torch.cat([steps[:, i : i + 1].expand(2, f) for i, f in enumerate(chunks)], dim=1)
    full = model(x, per_frame_t, ctx, block_causal_frames=chunks)
    assert (torch.cat(outs, 2) - full).abs().max() < 1e-4
    if len(set(chunks)) == 1:
        assert torch.equal(full, model(x, per_frame_t, ctx, block_causal_frames=chunks[0]))
    assert cache.fill == [6, 6]


@pytest.mark.parametrize(
    "policy, slots, sink, refresh_at",
    [("window", 4, 2, 50), ("refresh", 4, 2, 9), ("refresh", 5, 0, 8), ("window", 3, 0, 50)],
)
def test_stream_with_eviction_equals_retained_frames_reference(model, policy, slots, sink, refresh_at):
    """Two stream-batch rows, row 1 starting one chunk later, over 14 chunks (evicting, refreshing)."""
    x, ctx = stream_inputs(2, 15, seed=3)
    cache = model.new_cache(
        2, (H, W), num_kv_cache=slots, sink=sink, rope_policy=policy, refresh_at=refresh_at, sink_threshold=-1
    )
    cross = model.cross_kv(ctx)
    refs = [RetainedFramesReference(model, slots, sink, policy, refresh_at) for _ in range(2)]
    for step in range(14):
        t = torch.tensor([800.0 - step, 500.0 + step])
        frames = [step, step - 1]  # row 1 lags one chunk; its first call is a dry run
        chunk = torch.stack([x[0, :, frames[0]], x[1, :, max(frames[1], 0)]])[:, :, None]
        out = model.forward_stream(chunk, t, cache, cross, commit=[True, frames[1] >= 0])
        for row in (0, 1):
            if frames[row] < 0:
                continue
            ref = refs[row].chunk(chunk[row : row + 1], t[row : row + 1], model.cross_kv(ctx[row : row + 1]))
            assert (out[row : row + 1] - ref).abs().max() < 1e-4, (step, row)
    assert cache.frames == [14, 13]


def test_refresh_without_sinks_changes_nothing(model):
    x, ctx = stream_inputs(1, 30, seed=4)
    cross = model.cross_kv(ctx)
    often = model.new_cache(1, (H, W), num_kv_cache=4, sink=0, refresh_at=6, sink_threshold=-1)
    never = model.new_cache(1, (H, W), num_kv_cache=4, sink=0, refresh_at=1024, sink_threshold=-1)
    worst = 0.0
    for i in range(30):
        t = torch.tensor([600.0])
        a = model.forward_stream(x[:, :, i : i + 1], t, often, cross)
        b = model.forward_stream(x[:, :, i : i + 1], t, never, cross)
        worst = max(worst, (a - b).abs().max().item())
    assert max(often.positions[0]) < 6 and max(never.positions[0]) == 29
    assert worst < 1e-4


def test_uncommitted_denoise_steps_match_the_committed_one(model):
    """Sequential mode: several denoise steps of one chunk, only the last commits."""
    x, ctx = stream_inputs(1, 8, seed=5)
    cross = model.cross_kv(ctx)
    cache = model.new_cache(1, (H, W), num_kv_cache=4, sink=1, sink_threshold=-1)
    for i in range(8):
        chunk = x[:, :, i : i + 1]
        snapshot = cache.copy()
        dry = model.forward_stream(chunk, torch.tensor([700.0]), cache, cross, commit=False)
        assert torch.equal(cache.k[0], snapshot.k[0]) and cache.frames == snapshot.frames
        wet = model.forward_stream(chunk, torch.tensor([700.0]), cache, cross, commit=True)
        assert torch.equal(dry, wet)


def test_prompt_swap_keeps_the_self_attention_cache(model):
    x, ctx = stream_inputs(1, 3, seed=6)
    cache = model.new_cache(1, (H, W), num_kv_cache=4, sink=1, sink_threshold=-1)
    for i in range(2):
        model.forward_stream(x[:, :, i : i + 1], torch.tensor([500.0]), cache, model.cross_kv(ctx))
    before = cache.copy()
    other = model.cross_kv(torch.randn(1, 4, CFG.text_dim))
    a = model.forward_stream(x[:, :, 2:3], torch.tensor([500.0]), cache, other, commit=False)
    b = model.forward_stream(x[:, :, 2:3], torch.tensor([500.0]), before, model.cross_kv(ctx), commit=False)
    assert not torch.allclose(a, b)
    assert torch.equal(cache.k[1], before.k[1])


def test_stream_rejects_mismatched_chunks(model):
    cache = model.new_cache(2, (H, W))
    cross = model.cross_kv(torch.randn(1, 4, CFG.text_dim))
    with pytest.raises(ValueError, match="token grid"):
        model.forward_stream(torch.randn(2, 16, 1, 8, 8), torch.ones(2), cache, cross)
    with pytest.raises(ValueError, match="for this cache"):
        model.forward_stream(torch.randn(1, 16, 1, H, W), torch.ones(1), cache, cross)


def test_sinks_adapt_and_refresh_inside_the_model(model):
    x, ctx = stream_inputs(2, 10, seed=7)
    cross = model.cross_kv(ctx)
    caches = {
        thr: model.new_cache(2, (H, W), num_kv_cache=4, sink=2, sink_threshold=thr) for thr in (-1.0, 1.5)
    }
    fixed, adaptive = caches[-1.0], caches[1.5]
    ring_v = {}
    for i in range(10):
        if i == 6:
            fixed.refresh_sinks(rows=[1])
        for cache in caches.values():
            model.forward_stream(x[:, :, i : i + 1], torch.tensor([600.0, 300.0]), cache, cross)
        ring_v[i] = fixed.v[1][:, 2 + (i - 2) % 2].clone() if i >= 2 else fixed.v[1][:, i].clone()
    # similarity is always below 1.5: frames after the sinks kept replacing them
    assert not torch.allclose(fixed.k[0][:, :2], adaptive.k[0][:, :2])
    assert adaptive.positions[0][:2] == [0, 1]
    # without adaptation, row 0 keeps frames 0 and 1 as sinks; row 1 took frames 6 and 7 after
    # its prompt change (refresh_sinks), one per committed frame
    assert torch.equal(fixed.v[1][0, 0], ring_v[0][0]) and torch.equal(fixed.v[1][0, 1], ring_v[1][0])
    assert torch.equal(fixed.v[1][1, 0], ring_v[6][1]) and torch.equal(fixed.v[1][1, 1], ring_v[7][1])
