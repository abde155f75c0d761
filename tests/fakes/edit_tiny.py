"""The edit family at test size: the `edit-tiny` preset at 32x32, B frames a batch, every adapter hook."""

from __future__ import annotations

import numpy as np

from loom_live.engine.config import LoomConfig, load_config

B = 2


def tiny_edit_cfg(*overrides: str) -> LoomConfig:
    return load_config("edit-tiny", ["resolution.width=32", "resolution.height=32", f"edit.batch={B}",
                                     "edit.lllite_hooks=all", *overrides])


def random_frames(n: int, seed: int = 0, hw: tuple[int, int] = (32, 32)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, *hw, 3), np.uint8)
