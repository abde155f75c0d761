"""A DiT that reads its input's clean latents (and edges) beside the noisy ones
(`WanDiTConfig.source_channels`, `source_edges`): streaming equals the block-causal pass, the denoiser
gives every chunk its own source in both modes, each frame slot holds that frame's codes and edges,
and a missing or misshapen source is refused with what was expected."""

from __future__ import annotations

from dataclasses import replace

import cv2
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from loom_live.engine.models.dit_source import EDGE_GAIN, dit_source, edge_strength
from loom_live.engine.models.wan_dit import DIT_PRESETS, SOURCE_EDGE_VALUES, LatentRefiner, WanDiT
from loom_live.engine.stream.denoiser import StreamDenoiser
from loom_live.engine.stream.schedule import FlowSchedule
from tests.fakes.wan_models import refined_model


def source_model(slots: int = 1) -> WanDiT:
    return refined_model(slots, source_channels=8, layers=2)


def context(model: WanDiT, batch: int) -> torch.Tensor:
    return torch.randn(batch, model.cfg.text_len, model.cfg.text_dim)


@pytest.mark.parametrize("slots", [1, 4])
def test_a_source_reading_stream_equals_the_block_causal_forward(slots):
    model = source_model(slots)
    torch.manual_seed(1)
    x, src = torch.randn(2, 8, 4, 4, 4), torch.randn(2, 8, 4, 4, 4)
    ctx = context(model, 2)
    steps = torch.tensor([[700.0, 700.0, 650.0, 600.0], [400.0, 400.0, 380.0, 300.0]])
    parts = ((0, 2), (2, 3), (3, 4))
    with torch.no_grad():
        cache, cross = model.new_cache(2, (4, 4)), model.cross_kv(ctx)
        outs = [model.forward_stream(x[:, :, s:e], steps[:, s], cache, cross, source=src[:, :, s:e])
                for s, e in parts]
        full = model(x, steps, ctx, block_causal_frames=[2, 1, 1], source=src)
        other = model(x, steps, ctx, block_causal_frames=[2, 1, 1], source=src.flip(0))
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=1e-4, rtol=1e-4)
    assert (other - full).abs().amax() > 1e-2  # the source is read, not only carried


def test_a_missing_or_misshapen_source_is_refused_with_the_expected_shape():
    model = source_model()
    x, t, ctx = torch.randn(1, 8, 1, 4, 4), torch.tensor([500.0]), context(model, 1)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"needs the chunk's clean source latents \[B, 8, F, H, W\]"):
            model(x, t, ctx)
        with pytest.raises(ValueError, match=r"must be \[1, 8, 1, 4, 4\].*got \(1, 8, 2, 4, 4\)"):
            model(x, t, ctx, source=torch.randn(1, 8, 2, 4, 4))
    with pytest.raises(ValueError, match="source_channels=6: must be >= 0 and divisible by refiner_slots=4"):
        replace(DIT_PRESETS["embedded"], refiner_slots=4, source_channels=6)


def test_a_slot_refiner_reads_each_frames_own_source_code_for_that_frame_only():
    torch.manual_seed(0)
    refiner = LatentRefiner(channels=12, width=8, slots=4, source_channels=12).eval()
    with torch.no_grad():
        for p in refiner.out.parameters():
            p.normal_(0.0, 0.3)
        x0, x_t, src = (torch.randn(2, 12, 2, 4, 4) for _ in range(3))
        sigma = torch.full((2, 1, 1, 1, 1), 0.4)
        base = refiner(x0, x_t, sigma, src)
        moved = src.clone()
        moved[:, 3:6] += 1.0  # slot 1 of 4 (3 codes each)
        diff = (refiner(x0, x_t, sigma, moved) - base).abs().sum(dim=(0, 2, 3, 4))
    assert diff[3:6].min() > 0 and diff[:3].sum() == 0 and diff[6:].sum() == 0


@pytest.mark.parametrize("edges", [False, True])
def test_stream_batch_gives_each_chunk_its_own_source_as_sequential_mode_does(edges):
    """In stream-batch mode a forward holds two chunks at different steps; each must be denoised
    beside its own clean latents (and edges). With two steps both modes draw the same noise in the
    same order, so they agree."""
    steps = [700, 500]
    model = refined_model(4, 8 + 4 * SOURCE_EDGE_VALUES, layers=2, edges=True) if edges else source_model(4)
    schedule = FlowSchedule(shift=0.25)
    cross = model.cross_kv(context(model, 1))
    torch.manual_seed(2)
    latents = [torch.randn(1, 8, 2, 4, 4)] + [torch.randn(1, 8, 1, 4, 4) for _ in range(5)]
    pixels = [torch.rand(1, 3, 5, 32, 32) * 2 - 1] + [torch.rand(1, 3, 4, 32, 32) * 2 - 1 for _ in range(5)]
    chunks = [(z, dit_source(model.cfg, z, p) if edges else None) for z, p in zip(latents, pixels)]

    def denoiser() -> StreamDenoiser:
        cache = model.new_cache(len(steps), (4, 4), num_kv_cache=3, sink=1)
        return StreamDenoiser(model, cache, cross, steps, schedule, torch.Generator().manual_seed(5))

    with torch.no_grad():
        seq = denoiser()
        want = [seq.run_sequential(z, 650.0, source=src) for z, src in chunks]
        bat = denoiser()
        want_first = bat.run_sequential(*chunks[0][:1], 650.0, source=chunks[0][1])  # the 2-latent first chunk alone
        got = []
        for z, src in chunks[1:]:
            got += [x0 for x0, _ in bat.push_batch(z, 650.0, None, source=src)]
        got += [x0 for x0, _ in bat.drain()]
    torch.testing.assert_close(want_first, want[0])
    assert len(got) == len(chunks) - 1
    for g, w in zip(got, want[1:]):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_the_edges_are_the_line_styles_own_measure():
    """The edge strength a DiT reads is what the line styles are drawn from (OpenCV on uint8 frames
    there, float on the device here: within a level's rounding)."""
    from loom_live.engine.train.styles import _edges, _grey

    frame = np.full((64, 64, 3), 30, np.uint8)
    cv2.circle(frame, (30, 28), 17, (250, 120, 40), -1)
    cv2.line(frame, (2, 60), (60, 40), (20, 230, 200), 2)
    frame = cv2.GaussianBlur(frame, (3, 3), 0)
    want = _edges(_grey(frame), 5)
    got = edge_strength(torch.from_numpy(frame).permute(2, 0, 1)[None].float() / 127.5 - 1.0)[0, 0].numpy()
    assert want.max() > 0.2
    assert np.abs(got - want).max() < 0.02 and np.abs(got - want).mean() < 0.002


def test_each_frame_slot_holds_that_frames_codes_and_edges_and_a_first_chunk_repeats_frame_0():
    cfg = refined_model(4, 8 + 4 * SOURCE_EDGE_VALUES, edges=True).cfg
    torch.manual_seed(3)
    for frames, lead in ((9, 3), (8, 0)):  # a stream's first chunk (1 + 4k frames), then a later one
        pixels = torch.rand(2, 3, frames, 16, 24) * 2 - 1
        z = torch.randn(2, 8, (frames + lead) // 4, 2, 3)
        slots = dit_source(cfg, z, pixels).unflatten(1, (4, 2 + SOURCE_EDGE_VALUES))
        edges = edge_strength(pixels.transpose(1, 2).flatten(0, 1)).unflatten(0, (2, frames))
        for f in range(z.shape[2]):
            for s in range(4):
                t = max(4 * f + s - lead, 0)
                torch.testing.assert_close(slots[:, s, :2, f], z[:, 2 * s:2 * s + 2, f])
                torch.testing.assert_close(slots[:, s, 2:, f], F.pixel_unshuffle(edges[:, t], 8) * EDGE_GAIN)
    with pytest.raises(ValueError, match=r"source pixels \(1, 3, 6, 16, 24\) do not match latents"):
        dit_source(cfg, torch.randn(1, 8, 2, 2, 3), torch.rand(1, 3, 6, 16, 24))
    assert dit_source(replace(cfg, source_channels=0, source_edges=False), z, pixels) is None


def test_the_edge_scale_multiplies_the_edges_alone_one_number_or_one_per_sample():
    """The edge control (`control.context_scale`, training's edge dropout): the codes stay, the edges are
    scaled, per sample when given a tensor; a scale of the wrong shape is refused with what was expected."""
    cfg = refined_model(4, 8 + 4 * SOURCE_EDGE_VALUES, edges=True).cfg
    torch.manual_seed(4)
    pixels, z = torch.rand(3, 3, 8, 16, 24) * 2 - 1, torch.randn(3, 8, 2, 2, 3)

    def split(source):
        slots = source.unflatten(1, (4, 2 + SOURCE_EDGE_VALUES))
        return slots[:, :, :2], slots[:, :, 2:]

    codes, edges = split(dit_source(cfg, z, pixels))
    assert edges.abs().max() > 0
    each = torch.tensor([0.0, 1.0, 1.5])
    for scale, want in ((0.0, edges * 0), (0.5, edges * 0.5), (each, edges * each.view(3, 1, 1, 1, 1, 1))):
        got_codes, got_edges = split(dit_source(cfg, z, pixels, scale))
        torch.testing.assert_close(got_codes, codes)
        torch.testing.assert_close(got_edges, want)
    with pytest.raises(ValueError, match=r"edge scale: one per sample \[3\] expected, got \(2,\)"):
        dit_source(cfg, z, pixels, torch.ones(2))
