"""The embedded model's per-frame VAE keeps the Wan stream geometry, and its DiT's x0 head gives the
flow every caller reads (engine/models/frame_vae.py, WanDiTConfig.prediction)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from loom_live.engine.models.frame_vae import FrameVAE, FrameVAEConfig
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.engine.stream.schedule import FlowSchedule
from tests.fakes.wan_models import refined_model

SMALL = FrameVAEConfig(frame_channels=8, encoder_width=16, decoder_width=16, upsample_width=8)


def randomised(vae: FrameVAE) -> FrameVAE:
    """The zero-initialised residual paths get values, so every layer takes part."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in vae.parameters():
            p.normal_(0.0, 0.05)
    return vae.eval()


def test_a_stream_of_chunks_equals_the_whole_clip_and_keeps_1_plus_4k_geometry():
    vae = randomised(FrameVAE(SMALL))
    x = torch.rand(2, 3, 13, 32, 48) * 2 - 1
    state = vae.new_stream_state()
    parts = [vae.encode_stream(c, state) for c in x.split([5, 4, 4], dim=2)]
    assert [p.shape[2] for p in parts] == [2, 1, 1] and parts[0].shape[1] == SMALL.latent_channels
    z = torch.cat(parts, dim=2)
    torch.testing.assert_close(z, vae.encode(x))
    dec = vae.new_stream_state()
    y = torch.cat([vae.decode_stream(z[:, :, i:i + 1], dec) for i in range(z.shape[2])], dim=2)
    assert y.shape == x.shape
    torch.testing.assert_close(y, vae.decode(z))


def test_a_latent_frame_holds_four_frames_coded_alone():
    """Frame t's pixels reach only latent frame (t + 3) // 4, in its slot (t + 3) % 4."""
    vae = randomised(FrameVAE(replace(SMALL, normalize_on_encode=False)))
    x = torch.zeros(1, 3, 9, 16, 16)
    base = vae.encode(x)
    x[:, :, 6] = 0.7  # frame 6: latent 2, slot 1
    diff = (vae.encode(x) - base).abs().sum(dim=(0, 3, 4))  # [C, T']
    c = SMALL.frame_channels
    assert diff[:, :2].sum() == 0 and diff[:c, 2].sum() == 0 and diff[2 * c:, 2].sum() == 0
    assert diff[c:2 * c, 2].sum() > 0


def test_the_round_trip_of_a_fresh_vae_starts_from_its_linear_block_codec():
    """The residual paths start at zero: decode(encode(x)) is the two 1x1 block maps alone."""
    vae = FrameVAE(SMALL).eval()
    x = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    with torch.no_grad():
        assert vae.encoder.body[-1].weight.abs().sum() == 0 and vae.decoder.body[-2].weight.abs().sum() == 0
        y = vae.decode_stream(vae.encode_stream(x, vae.new_stream_state()), vae.new_stream_state(), clamp=False)
        blocks = torch.nn.functional.pixel_unshuffle(x[0].transpose(0, 1), 8)
        want = torch.nn.functional.pixel_shuffle(vae.decoder.linear(vae.encoder.linear(blocks)), 8)
    torch.testing.assert_close(y[0].transpose(0, 1), want, atol=1e-5, rtol=1e-5)


def test_bad_latent_stats_are_refused_with_the_count_needed():
    with pytest.raises(ValueError, match="need 32 values"):
        FrameVAE(replace(SMALL, latents_mean=(0.0,) * 3))


@pytest.mark.parametrize("stream", [False, True])
def test_an_x0_head_gives_the_flow_whose_x0_is_the_head_output(stream):
    cfg = replace(DIT_PRESETS["embedded"], source_channels=0, source_edges=False, num_layers=1, in_channels=8,
                  out_channels=8)
    torch.manual_seed(0)
    model = WanDiT(cfg).eval()
    x = torch.randn(2, 8, 2, 4, 4)
    t = torch.tensor([600.0, 250.0])
    ctx = torch.randn(2, cfg.text_len, cfg.text_dim)
    with torch.no_grad():
        def run() -> torch.Tensor:
            if not stream:
                return model(x, t, ctx)
            return model.forward_stream(x, t, model.new_cache(2, (4, 4)), model.cross_kv(ctx))

        flow = run()
        model.head.prediction = "flow"  # the same head read as it is
        raw = run()
    torch.testing.assert_close(FlowSchedule.to_x0(x, flow, (t / 1000).view(2, 1, 1, 1, 1)), raw,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("slots", [1, 4])
def test_a_refined_x0_stream_equals_the_block_causal_forward(slots):
    """The refiner sees one latent frame at a time: streaming stays what the full causal pass gives."""
    model = refined_model(slots)
    torch.manual_seed(1)
    x = torch.randn(2, 8, 4, 4, 4)
    ctx = torch.randn(2, model.cfg.text_len, model.cfg.text_dim)
    steps = torch.tensor([[700.0, 700.0, 650.0, 600.0], [400.0, 400.0, 380.0, 300.0]])
    with torch.no_grad():
        cache, cross = model.new_cache(2, (4, 4)), model.cross_kv(ctx)
        outs = [model.forward_stream(x[:, :, s:e], steps[:, s], cache, cross) for s, e in ((0, 2), (2, 3), (3, 4))]
        full = model(x, steps, ctx, block_causal_frames=[2, 1, 1])
    torch.testing.assert_close(torch.cat(outs, 2), full, atol=1e-4, rtol=1e-4)


def test_the_refiner_changes_the_clean_estimate_per_latent_pixel_and_starts_as_the_identity():
    model = refined_model()
    x, t = torch.randn(1, 8, 1, 4, 4), torch.tensor([500.0])
    ctx = torch.randn(1, model.cfg.text_len, model.cfg.text_dim)
    with torch.no_grad():
        refined = model(x, t, ctx)
        model.head.refiner.out.weight.zero_()
        model.head.refiner.out.bias.zero_()
        plain = model(x, t, ctx)
        model.head.refiner = None
        torch.testing.assert_close(model(x, t, ctx), plain)
    assert (refined - plain).abs().amax() > 1e-2
    with pytest.raises(ValueError, match="refiner_width"):
        replace(DIT_PRESETS["embedded"], source_channels=0, source_edges=False, prediction="flow")


def test_the_refiner_style_layer_starts_as_none_and_each_token_then_steers_its_own_pixels():
    """At zero the style layer changes nothing (a trained refiner gains it unchanged); given values,
    a change in one token's features moves the refinement of the 2x2 latent pixels it covers in every
    frame slot and, through the two 3x3 layers after it, the pixels up to two away: no other frame,
    sample or pixel."""
    from loom_live.engine.models.wan_dit import LatentRefiner

    torch.manual_seed(0)
    plain = LatentRefiner(channels=12, width=8, slots=4).eval()
    styled = LatentRefiner(channels=12, width=8, slots=4, style_dim=16).eval()
    styled.load_state_dict(plain.state_dict(), strict=False)
    x0, x_t, sigma = torch.randn(2, 12, 2, 8, 8), torch.randn(2, 12, 2, 8, 8), torch.full((2, 1, 1, 1, 1), 0.4)
    tokens = torch.randn(2, 2, 4, 4, 16)  # [B, F, h, w, dim]: each token over 2x2 latent pixels
    with torch.no_grad():
        for p in plain.out.parameters():
            p.normal_(0.0, 0.3)
        styled.out.load_state_dict(plain.out.state_dict())
        torch.testing.assert_close(styled(x0, x_t, sigma, tokens=tokens), plain(x0, x_t, sigma))
        for p in styled.style.parameters():
            p.normal_(0.0, 0.3)
        base = styled(x0, x_t, sigma, tokens=tokens)
        moved = tokens.clone()
        moved[1, 0, 0, 3] += 1.0  # sample 1, frame 0, token row 0, column 3: latent rows 0-1, columns 6-7
        diff = (styled(x0, x_t, sigma, tokens=moved) - base).abs()
        assert diff[1, :, 0, 0:2, 6:8].amin() > 0  # every slot's codes of the covered pixels
        diff[1, :, 0, 0:4, 4:8] = 0  # those and their neighbours up to two away
        assert diff.sum() == 0
        with pytest.raises(ValueError, match="reads the head's tokens"):
            styled(x0, x_t, sigma)
    with pytest.raises(ValueError, match="refiner_style needs a refiner"):
        replace(DIT_PRESETS["embedded"], refiner_width=0)


def test_a_slot_refiner_reads_each_frames_own_noisy_code_for_that_frame_only():
    """Per frame slot: a change in one frame's noisy code moves that frame's refined code only (the
    clean estimate is the shared context), and every slot is refined by the same weights."""
    from loom_live.engine.models.wan_dit import LatentRefiner

    torch.manual_seed(0)
    refiner = LatentRefiner(channels=12, width=8, slots=4).eval()
    with torch.no_grad():
        for p in refiner.out.parameters():
            p.normal_(0.0, 0.3)
        x0, x_t, sigma = torch.randn(2, 12, 2, 4, 4), torch.randn(2, 12, 2, 4, 4), torch.full((2, 1, 1, 1, 1), 0.4)
        base = refiner(x0, x_t, sigma)
        moved = x_t.clone()
        moved[:, 6:9] += 1.0  # slot 2 of 4 (3 codes each)
        diff = (refiner(x0, moved, sigma) - base).abs().sum(dim=(0, 2, 3, 4))
        assert diff[6:9].min() > 0 and diff[:6].sum() == 0 and diff[9:].sum() == 0
        # the same weights for every slot: four copies of one frame get four equal corrections
        one_x0, one_xt = torch.randn(2, 3, 2, 4, 4), torch.randn(2, 3, 2, 4, 4)
        same = refiner(one_x0.repeat(1, 4, 1, 1, 1), one_xt.repeat(1, 4, 1, 1, 1), sigma).unflatten(1, (4, 3))
        for j in range(1, 4):
            torch.testing.assert_close(same[:, j], same[:, 0])
        assert (same[:, 0] - one_x0).abs().amax() > 1e-2
