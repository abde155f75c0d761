"""Low-VRAM mode: text encoder placement, one-latent chunks, tiled VAE, and a config conflict."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom_live.engine.config import ConfigError, load_config
from loom_live.engine.models.vae_tiling import TiledVAE
from loom_live.engine.stream.session import StreamSession, _encoder_device


def _run(overrides: list[str]) -> tuple[StreamSession, np.ndarray]:
    cfg = load_config("tiny-random", ["resolution.width=64", "resolution.height=64", "stream.mode=batch", *overrides])
    frames = np.random.default_rng(1).integers(0, 255, (17, 64, 64, 3), dtype=np.uint8)
    s = StreamSession.from_config(cfg, warmup=False)
    out = [s.push(frames[i:i + 4]) for i in range(0, 17, 4)] + [s.flush()]
    return s, np.concatenate([o for o in out if len(o)])


def test_low_vram_with_one_tile_gives_the_normal_output():
    """A frame within one tile goes through the VAE untouched: the mode costs nothing in quality."""
    _, normal = _run([])
    s, low = _run(["memory.low_vram=true"])
    assert isinstance(s.models.decoder, TiledVAE) and s.slo.max_chunk_latents == 1
    assert np.array_equal(low, normal)


def test_low_vram_tiles_a_frame_larger_than_a_tile():
    _, normal = _run([])
    _, low = _run(["memory.low_vram=true", "memory.vae_tile_latents=6", "memory.vae_tile_overlap=2"])
    assert low.shape == normal.shape == (17, 64, 64, 3)
    assert not np.array_equal(low, normal)  # 8x8 latents in 6-latent tiles: really tiled


def test_low_vram_keeps_the_text_encoder_on_the_cpu():
    gpu = torch.device("cuda")
    assert _encoder_device("auto", gpu, low_vram=True) == "cpu"
    assert _encoder_device("auto", gpu, low_vram=False) == "cuda"


def test_low_vram_refuses_a_text_encoder_on_the_gpu():
    with pytest.raises(ConfigError, match="low_vram"):
        load_config("tiny-random", ["memory.low_vram=true", "prompt.device=cuda"])
