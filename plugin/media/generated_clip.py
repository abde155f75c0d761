"""Loom's built-in clip (``generate_clip``): moving textured squares and discs over a drifting gradient.

The player's and ``loom eval``'s ``generated`` input, and what tests, benchmarks and examples read: it needs no
file, no camera and no decoder, only numpy, and depends only on its size, seed and frame index.
"""

from __future__ import annotations

import numpy as np

from loom_live.plugin.media.base import FrameSource, MediaError, check_size


class _GeneratedSource(FrameSource):
    """Deterministic moving shapes over a drifting gradient, rendered on demand (constant memory).

    Textured squares and smooth discs give optical flow something to track, and the whole clip
    depends only on (size, seed, frame index), so tests and first runs see the same frames.
    """

    def __init__(self, n_frames: int, width: int, height: int, fps: float, seed: int):
        super().__init__(f"generated clip (seed {seed})", fps, width, height, n_frames, is_live=False)
        rng = np.random.default_rng(seed)
        n_shapes = 6
        self._pos = rng.uniform(0.1, 0.9, (n_shapes, 2)) * (width, height)
        self._vel = rng.uniform(1.5, 5.0, (n_shapes, 2)) * rng.choice([-1.0, 1.0], (n_shapes, 2))
        self._radius = rng.uniform(0.06, 0.14, n_shapes) * min(width, height)
        self._colour = rng.uniform(30, 255, (n_shapes, 3))
        self._square = rng.random(n_shapes) < 0.5
        self._phase = rng.uniform(0, 2 * np.pi, 3)
        self._y = np.arange(height, dtype=np.float32)[:, None]  # pixel rows and columns, broadcast
        self._x = np.arange(width, dtype=np.float32)[None, :]
        self._index = 0

    def frame(self, t: int) -> np.ndarray:
        """Frame number ``t`` (any t >= 0, also beyond ``frame_count``).

        Each shape is drawn only inside its bounding box: a player run or a benchmark reads this
        clip as its input, and drawing every shape over the whole frame cost more than the engine's
        pass-through path."""
        w, h = self.width, self.height
        u, v = self._x / w, self._y / h
        img = np.empty((h, w, 3), np.float32)
        for c in range(3):
            wave = 2 * np.pi * (u * (c + 1) * 0.5 + v * 0.7 + 0.01 * t) + self._phase[c]
            img[..., c] = 90 + 60 * np.sin(wave)
        img = img.astype(np.float64)  # the shapes' colours are float64
        shapes = zip(self._pos, self._vel, self._radius, self._colour, self._square)
        for pos, vel, r, colour, square in shapes:
            cx = _bounce(pos[0] + vel[0] * t, r, w - r)
            cy = _bounce(pos[1] + vel[1] * t, r, h - r)
            rows = slice(max(0, int(np.floor(cy - r))), min(h, int(np.ceil(cy + r)) + 1))
            cols = slice(max(0, int(np.floor(cx - r))), min(w, int(np.ceil(cx + r)) + 1))
            dx, dy = self._x[:, cols] - cx, self._y[rows] - cy
            if square:
                mask = (np.abs(dx) < r) & (np.abs(dy) < r)
                checker = ((np.floor(dx / (r / 3)) + np.floor(dy / (r / 3))) % 2)[..., None]
                fill = colour * (0.55 + 0.45 * checker)
            else:
                mask = dx * dx + dy * dy < r * r
                fill = colour * (1.0 - 0.4 * np.sqrt(dx * dx + dy * dy)[..., None] / r)
            box = img[rows, cols]
            box[...] = np.where(mask[..., None], fill, box)
        return np.clip(img, 0, 255).astype(np.uint8)

    def _read(self) -> np.ndarray | None:
        if self._index >= (self.frame_count or 0):
            return None
        self._index += 1
        return self.frame(self._index - 1)


def _bounce(x: float, lo: float, hi: float) -> float:
    """Position moving back and forth between lo and hi (a triangle wave of the free path)."""
    span = hi - lo
    if span <= 0:
        return (lo + hi) / 2
    x = (x - lo) % (2 * span)
    return lo + (x if x <= span else 2 * span - x)


def generate_clip(n_frames: int = 120, size: tuple[int, int] = (832, 480), fps: float = 24.0,
                  seed: int = 0) -> FrameSource:
    """A built-in test clip: ``n_frames`` of moving shapes at ``size`` = (width, height)."""
    if n_frames < 1:
        raise MediaError(f"generated clip: n_frames must be >= 1, got {n_frames}")
    width, height = check_size(size, "generated clip")
    if not fps > 0:
        raise MediaError(f"generated clip: fps must be > 0, got {fps}")
    return _GeneratedSource(n_frames, width, height, float(fps), seed)
