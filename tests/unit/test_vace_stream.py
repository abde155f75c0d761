"""VACE streaming: control latents stream chunk by chunk beside the video latents, the control blocks keep
their K/V in the same cache, and the reference image is a pinned first entry. The oracle is the
full-sequence forward with the block-causal mask, the reference as its first block at timestep 0."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.models.wan_vace import ControlLatents, WanVaceConfig, reference_entry
from tests.fakes.wan_models import random_vace

CFG = WanVaceConfig(dim=48, ffn_dim=64, num_heads=2, num_layers=3, text_dim=32, text_len=16, freq_dim=32,
                    vace_layers=(0, 2))  # 96 control channels, as released
H, W = 4, 6


@pytest.fixture(scope="module")
def model():
    return random_vace(CFG)


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():
        yield


def inputs(batch: int, frames: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 16, frames, H, W, generator=g),
            torch.randn(batch, CFG.vace_in_channels, frames, H, W, generator=g),
            torch.randn(batch, CFG.text_len, CFG.text_dim, generator=g))


def with_reference(model, cache, cross, ref: torch.Tensor) -> None:
    """Commit the reference entry (timestep 0) and pin it as the first sink."""
    latent, control = reference_entry(ref)
    model.forward_stream(latent, torch.zeros(latent.shape[0]), cache, cross, control=control)
    cache.pin_sinks(1)


@pytest.mark.parametrize("policy", ["refresh", "window"])
@pytest.mark.parametrize("chunks, reference", [([1, 1, 1, 1, 1], False), ([2, 1, 2], True), ([1, 2, 1, 1], True)])
def test_stream_equals_block_causal_forward(model, policy, chunks, reference):
    x, control, ctx = inputs(2, sum(chunks), seed=len(chunks))
    steps = torch.tensor([[900.0], [300.0]]) - 40.0 * torch.arange(len(chunks))
    scales = torch.tensor([[0.8], [1.3]]) * torch.linspace(1.0, 0.5, len(chunks))  # per row, changing per chunk
    cache = model.new_cache(2, (H, W), num_kv_cache=6, sink=2, rope_policy=policy, sink_threshold=-1)
    assert set(model.control_block_ids()) <= set(cache.blocks)
    cross = model.cross_kv(ctx)
    ref = torch.randn(2, 16, 1, H, W, generator=torch.Generator().manual_seed(9))
    if reference:
        with_reference(model, cache, cross, ref)
    outs, start = [], 0
    for i, f in enumerate(chunks):
        part = slice(start, start + f)
        outs.append(model.forward_stream(x[:, :, part], steps[:, i], cache, cross, control=control[:, :, part],
                                         context_scale=scales[:, i]))
        start += f
    per_frame = lambda v: torch.cat([v[:, i:i + 1].expand(2, f) for i, f in enumerate(chunks)], dim=1)  # noqa: E731
    t, s, blocks = per_frame(steps), per_frame(scales), list(chunks)
    full_x, full_c = x, control
    if reference:
        ref_latent, ref_control = reference_entry(ref)
        full_x, full_c = torch.cat((ref_latent, x), 2), torch.cat((ref_control, control), 2)
        t = torch.cat((torch.zeros(2, 1), t), 1)
        s = torch.cat((torch.ones(2, 1), s), 1)  # the reference's own hint scale only shapes its cached K/V
        blocks = [1, *chunks]
    full = model(full_x, t, ctx, block_causal_frames=blocks, control=ControlLatents(full_c, s))
    if reference:
        full = full[:, :, 1:]
    assert (torch.cat(outs, 2) - full).abs().max() < 1e-4


def test_scale_switch_equals_a_stream_switched_at_that_chunk(model):
    """Changing context_scale between chunks leaves what came before and changes what follows."""
    x, control, ctx = inputs(1, 6, seed=11)
    cross = model.cross_kv(ctx)
    runs = {}
    for name, switch in (("steady", None), ("switched", 3)):
        cache = model.new_cache(1, (H, W), num_kv_cache=4, sink=1, sink_threshold=-1)
        outs = []
        for i in range(6):
            scale = 0.25 if switch is not None and i >= switch else 1.0
            outs.append(model.forward_stream(x[:, :, i:i + 1], torch.tensor([600.0]), cache, cross,
                                             control=control[:, :, i:i + 1], context_scale=scale))
        runs[name] = outs
    for i in range(3):
        assert torch.equal(runs["steady"][i], runs["switched"][i])
    assert all((runs["steady"][i] - runs["switched"][i]).abs().max() > 1e-3 for i in range(3, 6))


def test_pinned_reference_survives_adaptive_and_refreshed_sinks(model):
    x, control, ctx = inputs(1, 12, seed=12)
    cross = model.cross_kv(ctx)
    cache = model.new_cache(1, (H, W), num_kv_cache=5, sink=2, sink_threshold=1.5, refresh_at=8)  # always adapt
    with_reference(model, cache, cross, torch.randn(1, 16, 1, H, W))
    pinned = {b: cache.k[b][:, 0].clone() for b in cache.blocks}
    first_sink = {b: None for b in cache.blocks}
    for i in range(12):
        if i == 6:
            cache.refresh_sinks()
        model.forward_stream(x[:, :, i:i + 1], torch.tensor([500.0]), cache, cross, control=control[:, :, i:i + 1])
        if i == 1:
            first_sink = {b: cache.k[b][:, 1].clone() for b in cache.blocks}
    for b in cache.blocks:  # main and control blocks alike
        assert torch.equal(cache.k[b][:, 0], pinned[b])
        assert not torch.equal(cache.k[b][:, 1], first_sink[b])  # the unpinned sink did move
    assert cache.positions[0][0] == 0


def test_chunk_without_control_is_refused(model):
    x, control, ctx = inputs(1, 1, seed=13)
    cache = model.new_cache(1, (H, W))
    with pytest.raises(ValueError, match="control latents"):
        model.forward_stream(x, torch.tensor([500.0]), cache, model.cross_kv(ctx))
    with pytest.raises(ValueError, match="context_scale must be"):
        model.forward_stream(x, torch.tensor([500.0]), cache, model.cross_kv(ctx), control=control,
                             context_scale=torch.ones(3))
