"""The tiny VACE model the CPU tests stream: its small config, a session on shared models, a clip."""

from __future__ import annotations

import numpy as np

from loom_live.engine.config import load_config
from loom_live.engine.models.loading import LoadedModels, load_models
from loom_live.engine.stream.session import StreamSession

SMALL = ["resolution.width=32", "resolution.height=32", "stream.steps=[700]", "stream.cuda_graphs=false"]


def tiny_vace_models() -> LoadedModels:
    return load_models(load_config("tiny-vace", SMALL))


def session(models: LoadedModels, *overrides: str) -> StreamSession:
    return StreamSession(load_config("tiny-vace", [*SMALL, *overrides]), models)


def clip(n: int) -> np.ndarray:
    """A moving bright square on a dark ground: edges, flow and grey all differ."""
    frames = np.full((n, 64, 64, 3), 30, np.uint8)
    for i in range(n):
        frames[i, 10 + i:30 + i, 12 + 2 * i:36 + 2 * i] = (220, 180, 90)
    return frames
