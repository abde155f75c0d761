"""The embedded model's recipe trains what the session runs (engine/train/recipe.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.engine.stream.denoiser import StreamDenoiser
from loom_live.engine.stream.motion_noise import MotionNoiseController
from loom_live.engine.stream.schedule import FlowSchedule
from loom_live.engine.train import recipe


@pytest.mark.parametrize("steps", [[700], [700, 500, 400]])
def test_unroll_equals_the_sequential_denoiser(steps):
    """The training unroll (a batch of streams, one cache per step) computes what
    StreamDenoiser.run_sequential computes for one stream, chunk by chunk, noise included."""
    torch.manual_seed(0)
    dit = WanDiT(DIT_PRESETS["embedded"]).eval()
    schedule = FlowSchedule(shift=0.25)
    cfg = recipe.RecipeConfig()
    z = torch.randn(1, DIT_PRESETS["embedded"].in_channels, 5, 4, 4)
    t0 = [torch.tensor([650.0]), torch.tensor([620.0]), torch.tensor([600.0]), torch.tensor([640.0])]
    ctx = torch.zeros(1, 4, 384)
    ctx[0, 0] = torch.randn(384)
    with torch.no_grad():
        cross = dit.cross_kv(ctx)
        got = recipe.unroll(dit, schedule, z, t0, cross, steps, cfg, torch.Generator().manual_seed(3))
        cache = dit.new_cache(len(steps), (4, 4), num_kv_cache=cfg.num_kv_cache, sink=cfg.sink,
                              refresh_at=cfg.rope_refresh_at, sink_threshold=cfg.sink_threshold)
        den = StreamDenoiser(dit, cache, cross, steps, schedule, torch.Generator().manual_seed(3))
        want = [den.run_sequential(zc, float(t[0])) for zc, t in zip(z.split([2, 1, 1, 1], dim=2), t0)]
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
