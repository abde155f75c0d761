"""CUDA-graph replay of the streaming DiT and VAE steps computes what eager mode computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.graphs.dit_steps import GraphedStreamForward
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.engine.stream.session import StreamSession

pytestmark = pytest.mark.gpu


def test_graphed_dit_step_matches_eager_over_refreshes_and_sink_changes():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(dev):
        model = WanDiT(DIT_PRESETS["tiny"]).eval()
    kw = dict(frame_shape=(8, 8), num_kv_cache=6, sink=3, refresh_at=9, sink_threshold=0.5, device=dev)
    eager_cache, graph_cache = model.new_cache(2, **kw), model.new_cache(2, **kw)
    cross = model.cross_kv(torch.randn(1, 16, 4096, device=dev))
    graphed = GraphedStreamForward(model)
    with torch.inference_mode():
        for i in range(40):
            x = torch.randn(2, 16, 1, 8, 8, device=dev)
            t = torch.tensor([700.0, 400.0], device=dev)
            if i == 20:
                cross = model.cross_kv(torch.randn(1, 16, 4096, device=dev))
                eager_cache.refresh_sinks()
                graph_cache.refresh_sinks()
            a = model.forward_stream(x, t, eager_cache, cross)
            b = graphed(x, t, graph_cache, cross)
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    assert graphed.replays > 20
    for blk in eager_cache.k:
        torch.testing.assert_close(graph_cache.k[blk], eager_cache.k[blk], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["batch", "sequential"])
def test_session_with_graphs_matches_session_without(mode):
    """Two steps: in batch mode the full batch's forward is graphed, in sequential mode each cache row's."""
    frames = np.random.default_rng(0).integers(0, 255, (45, 64, 64, 3), dtype=np.uint8)
    outs = []
    for graphs in ("true", "false"):
        cfg = load_config("tiny-random", ["resolution.width=64", "resolution.height=64", "model.dtype=float32",
                                 f"stream.mode={mode}", f"stream.cuda_graphs={graphs}"])
        s = StreamSession.from_config(cfg)
        replayed = s.denoiser.graphed_forward.replays if graphs == "true" else 0
        got = [s.push(frames[i:i + 4]) for i in range(0, 45, 4)] + [s.flush()]
        outs.append(np.concatenate([g for g in got if len(g)]).astype(np.int16))
        if graphs == "true":  # every steady forward replayed (of 11 chunks, 6 steady: one forward or two rows)
            assert s.denoiser.graphed_forward.replays - replayed == (6 if mode == "batch" else 14)
    assert outs[0].shape == (45, 64, 64, 3)
    assert np.abs(outs[0] - outs[1]).max() <= 2
