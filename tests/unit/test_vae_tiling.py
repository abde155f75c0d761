"""Spatially tiled streaming VAE: exactness where it must be exact, blending, memory, state."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.graphs.vae_steps import VAEGraphs
from loom_live.engine.models.taehv import TinyVAE
from loom_live.engine.models.vae_tiling import LATENT_SCALE, TiledVAE, blend_weights, tile_spans
from loom_live.engine.models.wan_vae import VAE_PRESETS, AttentionBlock, WanVAE

ENCODE_CHUNKS = (5, 4, 8)  # pixel frames: 1 + 4k first, then 4k
DECODE_CHUNKS = (1, 2, 1)  # latents: the first alone, then more


def _randomize_gains(vae: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def _wan() -> WanVAE:
    torch.manual_seed(0)
    vae = WanVAE(VAE_PRESETS["tiny"]).eval()
    _randomize_gains(vae, 1)
    return vae


def _taehv() -> TinyVAE:
    torch.manual_seed(0)
    return TinyVAE().eval()


def _spatially_local(vae: torch.nn.Module) -> torch.nn.Module:
    """The same architecture made spatially local: every 3x3 kernel keeps only its centre tap and
    the mid-block attention adds nothing. Each latent cell then depends only on its own 8x8 pixel
    block (and each pixel on its own latent cell), still causally on all past frames, so any
    correct tiling must reproduce the untiled result exactly."""
    with torch.no_grad():
        for m in vae.modules():
            if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)) and m.kernel_size[-1] == 3:
                centre = m.weight[..., 1:2, 1:2].clone()
                m.weight.zero_()
                m.weight[..., 1:2, 1:2] = centre
            elif isinstance(m, AttentionBlock):
                m.proj.weight.zero_()
                m.proj.bias.zero_()
    return vae


def _video(frames: int, h: int, w: int, seed: int) -> torch.Tensor:
    return torch.rand(1, 3, frames, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _latents(frames: int, h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randn(1, 16, frames, h, w, generator=torch.Generator().manual_seed(seed))


def _stream(step, x: torch.Tensor, chunks: tuple[int, ...], state) -> torch.Tensor:
    parts, start = [], 0
    for n in chunks:
        parts.append(step(x[:, :, start:start + n], state))
        start += n
    return torch.cat(parts, dim=2)


def _streams(vae, x: torch.Tensor, z: torch.Tensor):
    """(encoded stream, decoded stream) of `vae` over the test chunks, one state for both."""
    state = vae.new_stream_state()
    return _stream(vae.encode_stream, x, ENCODE_CHUNKS, state), _stream(vae.decode_stream, z, DECODE_CHUNKS, state)


@torch.no_grad()
@pytest.mark.parametrize("make", [_wan, _taehv], ids=["wan", "taehv"])
@pytest.mark.parametrize("tile", [4, 7])
def test_frame_within_one_tile_is_exactly_untiled(make, tile):
    vae = make()
    x, z = _video(sum(ENCODE_CHUNKS), 32, 24, seed=2), _latents(sum(DECODE_CHUNKS), 4, 3, seed=3)
    tiled = TiledVAE(vae, tile_latents=tile, overlap_latents=2)
    (ze, xd), (ze_ref, xd_ref) = _streams(tiled, x, z), _streams(vae, x, z)
    assert ze.shape == ze_ref.shape == (1, 16, 5, 4, 3) and xd.shape == xd_ref.shape == (1, 3, 13, 32, 24)
    assert (ze - ze_ref).abs().max() < 1e-6 and (xd - xd_ref).abs().max() < 1e-6


@torch.no_grad()
@pytest.mark.parametrize("make", [_wan, _taehv], ids=["wan", "taehv"])
def test_many_tiles_of_a_local_model_reassemble_exactly(make):
    """With a spatially local model the only thing tiling can get wrong is the assembly: crop
    placement, blend weights summing to 1, per-tile stream states. All must be exact."""
    vae = _spatially_local(make())
    x, z = _video(sum(ENCODE_CHUNKS), 48, 80, seed=4), _latents(sum(DECODE_CHUNKS), 6, 10, seed=5)
    tiled = TiledVAE(vae, tile_latents=4, overlap_latents=2)  # 2 x 4 tiles, a 1-row tile grid at 4 x 10
    (ze, xd), (ze_ref, xd_ref) = _streams(tiled, x, z), _streams(vae, x, z)
    assert xd_ref.std() > 0.01 and ze_ref.std() > 0.01, "a flat output would make the check weak"
    assert ze.shape == ze_ref.shape and xd.shape == xd_ref.shape == (1, 3, 13, 48, 80)
    assert (ze - ze_ref).abs().max() < 1e-6 and (xd - xd_ref).abs().max() < 1e-6


@torch.no_grad()
def test_tiled_decode_stays_close_and_streams_exactly():
    """Full tiny Wan VAE with random weights, 12 x 12 latents in tiles of 6.

    Not exact: a tile sees zero padding where its neighbours are, and the decoder's 3x3 conv
    stack (about 15 latent cells of radius) plus its frame-wide mid-block attention reach far
    beyond any overlap at this size; random weights do not damp far context the way trained
    ones do. Measured mean |tiled - untiled|: 0.19 with no overlap, 0.13 with 4 cells of
    overlap (outputs have std 0.32). What must hold: the shape, streaming tiled == one-shot
    tiled (per-tile caches make chunking exact) and that the overlap blending helps.
    """
    vae = _wan()
    z = _latents(3, 12, 12, seed=6)
    untiled = vae.decode(z)
    errors = {}
    for overlap in (0, 4):
        tiled = TiledVAE(vae, tile_latents=6, overlap_latents=overlap)
        streamed = _stream(tiled.decode_stream, z, (1, 1, 1), tiled.new_stream_state())
        assert streamed.shape == untiled.shape == (1, 3, 9, 96, 96)
        if overlap:
            assert (streamed - tiled.decode(z)).abs().max() < 1e-5
        errors[overlap] = (streamed - untiled).abs().mean().item()
    assert errors[4] < 0.15 and errors[4] < 0.8 * errors[0], errors


def test_tile_spans_cover_evenly_with_at_least_the_overlap():
    for length in range(1, 40):
        for tile in range(1, 12):
            for overlap in range(tile):
                spans = tile_spans(length, tile, overlap)
                assert spans[0][0] == 0 and spans[-1][1] == length
                assert len({e - s for s, e in spans}) == 1 and spans[0][1] <= tile
                assert all(b[0] > a[0] and a[1] - b[0] >= overlap for a, b in zip(spans, spans[1:]))
                # no more tiles than needed, and no larger: one fewer tile of the largest size, or
                # as many tiles one cell smaller, could not cover with that overlap
                n, size = len(spans), spans[0][1]
                assert n == 1 or ((n - 2) * (tile - overlap) + tile < length
                                  and n * (size - 1) - (n - 1) * overlap < length)
    # 480 x 832 px in tiles of at most 256 px overlapping by at least 64 px: 26 x 32 latent tiles
    assert tile_spans(60, 32, 8) == [(0, 26), (17, 43), (34, 60)]
    assert tile_spans(104, 32, 8) == [(0, 32), (24, 56), (48, 80), (72, 104)]


@pytest.mark.parametrize("spans", [[(0, 4), (2, 6), (4, 8)], [(0, 6), (1, 7), (2, 8)], [(0, 4), (4, 8)],
                                   [(0, 5)]])
def test_blend_weights_sum_to_one_and_ramp(spans):
    scale = LATENT_SCALE
    weights = blend_weights(spans, scale)
    total = torch.zeros(spans[-1][1] * scale)
    cover = torch.zeros_like(total)
    for (s, e), w in zip(spans, weights):
        assert w.shape == ((e - s) * scale,) and (w > 0).all()
        total[s * scale:e * scale] += w
        cover[s * scale:e * scale] += 1
    assert (total - 1).abs().max() < 1e-6
    for (s, e), w in zip(spans, weights):
        alone = cover[s * scale:e * scale] == 1
        assert (w[alone] == 1).all()  # one tile alone passes through unweighted
    if len(spans) == 2 and spans[0][1] > spans[1][0]:  # a plain two-tile overlap is a linear ramp
        ramp = weights[1][: (spans[0][1] - spans[1][0]) * scale]
        assert torch.allclose(ramp.diff(), ramp.diff()[0].expand_as(ramp.diff()), atol=1e-6)


@torch.no_grad()
def test_largest_activation_shrinks_with_the_tile_area():
    """The memory argument: every activation in a tile step is a tile-sized crop, so the largest
    tensor the model produces shrinks by the tile/frame area ratio (attention scores, not module
    outputs, shrink by its square)."""
    vae = _wan()
    z = _latents(2, 12, 12, seed=7)
    largest = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: largest.append(out.numel()))
             for m in vae.modules() if m is not vae]
    try:
        vae.decode(z)
        untiled, largest[:] = max(largest), []
        TiledVAE(vae, tile_latents=4, overlap_latents=2).decode(z)
        tiled = max(largest)
    finally:
        for h in hooks:
            h.remove()
    assert tiled * (12 * 12) == untiled * (4 * 4)


@torch.no_grad()
def test_state_copy_reset_and_size_change():
    vae = _wan()
    tiled = TiledVAE(vae, tile_latents=4, overlap_latents=2)
    z = _latents(4, 6, 6, seed=8)
    state = tiled.new_stream_state()
    first = tiled.decode_stream(z[:, :, :1], state)
    assert len(state.decoder.states) == 4 and state.decoder.started and not state.encoder.started
    snapshot = state.copy()
    a = tiled.decode_stream(z[:, :, 1:2], state)
    tiled.decode_stream(-z[:, :, 2:3], state)  # move the original on with other latents
    assert torch.equal(tiled.decode_stream(z[:, :, 1:2], snapshot), a)  # the copy did not move

    with pytest.raises(ValueError, match="reset"):
        tiled.decode_stream(_latents(1, 6, 8, seed=9), state)

    plan, buffers = state.decoder.plan, {k: v.data_ptr() for k, v in state.decoder.buffers.items()}
    size = state.nbytes()
    state.reset()
    assert not state.decoder.started
    assert torch.equal(tiled.decode_stream(z[:, :, :1], state), first)
    # reset in place: same plan and history memory (what captured CUDA graphs point at)
    assert state.decoder.plan is plan and {k: v.data_ptr() for k, v in state.decoder.buffers.items()} == buffers
    tiled.decode_stream(z[:, :, 1:2], state)
    assert state.nbytes() == size > 0  # flat over the stream
    tiled.decode_stream(z[:, :, 2:4], state)  # a step of two latents: room for its frames, once
    grown = state.nbytes()
    tiled.decode_stream(z[:, :, 1:3], state)
    assert state.nbytes() == grown > size

    state.reset()  # a new stream may change size: 2 x 3 tiles now
    out = tiled.decode_stream(_latents(2, 6, 8, seed=10), state)
    assert out.shape == (1, 3, 5, 48, 64) and len(state.decoder.states) == 6


@torch.no_grad()
def test_session_step_runner_drives_tiled_streams():
    """The session runs the VAE through `VAEGraphs` (one-latent steady steps); a tiled state
    must look like a stream cache to it (started, buffers) and give the same result."""
    vae = _wan()
    tiled = TiledVAE(vae, tile_latents=4, overlap_latents=2)
    x = _video(13, 48, 48, seed=11)
    steps, direct, driven = VAEGraphs(enabled=False), tiled.new_stream_state(), tiled.new_stream_state()
    z = _stream(tiled.encode_stream, x, (5, 8), direct)
    z_steps = torch.cat([steps.run("encode", tiled.encode_stream, x[:, :, :5], driven),
                         steps.run("encode", tiled.encode_stream, x[:, :, 5:], driven)], dim=2)
    assert (z_steps - z).abs().max() < 1e-5
    out = _stream(tiled.decode_stream, z, (1, 3), direct)
    out_steps = torch.cat([steps.run("decode", tiled.decode_stream, z[:, :, :1], driven),
                           steps.run("decode", tiled.decode_stream, z[:, :, 1:], driven)], dim=2)
    assert (out_steps - out).abs().max() < 1e-5


def test_bad_arguments_are_explained():
    vae = TinyVAE()
    with pytest.raises(ValueError, match="tile_latents > overlap_latents >= 0"):
        TiledVAE(vae, tile_latents=4, overlap_latents=4)
    with pytest.raises(ValueError, match="tile_latents > overlap_latents >= 0"):
        TiledVAE(vae, tile_latents=4, overlap_latents=-1)
    with pytest.raises(ValueError, match="overlap_latents must be an int"):
        TiledVAE(vae, tile_latents=4, overlap_latents=1.5)
    with pytest.raises(ValueError, match="no encode_stream"):
        TiledVAE(torch.nn.Identity(), tile_latents=4, overlap_latents=1)
    tiled = TiledVAE(vae, tile_latents=4, overlap_latents=1)
    state = tiled.new_stream_state()
    with pytest.raises(ValueError, match="multiples of 8, got 20x16"):
        tiled.encode_stream(torch.zeros(1, 3, 5, 20, 16), state)
    with pytest.raises(ValueError, match=r"latents \[B, z_dim, T, h, w\]"):
        tiled.decode_stream(torch.zeros(16, 1, 4, 4), state)
    # the model's own checks still apply to every tile; a refused first chunk starts nothing
    with pytest.raises(ValueError, match="16 latent channels"):
        tiled.decode_stream(torch.zeros(1, 4, 1, 8, 8), state)
    assert state.decoder.signature is None


@pytest.mark.gpu
@torch.no_grad()
def test_tiled_decode_step_captures_as_a_cuda_graph():
    from loom_live.engine.graphs.vae_steps import GraphedStep

    vae = _wan().to("cuda")
    tiled = TiledVAE(vae, tile_latents=4, overlap_latents=2)
    z = torch.randn(1, 16, 4, 8, 8, device="cuda")
    state = tiled.new_stream_state()
    tiled.decode_stream(z[:, :, :1], state)
    eager = state.copy()
    step = GraphedStep(lambda latents: tiled.decode_stream(latents, state), z[:, :, 1:2], cache=state.decoder)
    for i in range(1, 4):
        expected = tiled.decode_stream(z[:, :, i:i + 1], eager)
        assert (step(z[:, :, i:i + 1]) - expected).abs().max() < 1e-3
