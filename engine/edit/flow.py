"""The adapter's condition: the previous output warped onto each new frame by optical flow.

Dense Farneback flow is measured between the inputs (the previous batch's last input and each
new frame), not the outputs, so the restyling does not disturb the motion estimate; the
previous output is then pulled along that flow. It runs on the CPU (OpenCV), on worker threads,
while the GPU works on the next batch, and it must finish within one batch: the batch after its
start waits for it. So the flow is measured at half the frame's resolution and scaled up: a
quarter of the work, and a frame up to a whole batch away from the previous input moves further
than full-resolution Farneback's pyramid follows well (docs/performance.md has the warp errors on
the DAVIS clips).
"""

from __future__ import annotations

from concurrent.futures import Executor
from functools import lru_cache

import cv2
import numpy as np

# Farneback settings: pyramid scale, levels, window, iterations, polynomial size and sigma
FARNEBACK = dict(pyr_scale=0.5, levels=3, winsize=15, iterations=3, poly_n=5, poly_sigma=1.2, flags=0)


FLOW_SCALE = 2  # the flow is measured on frames this many times smaller in each dimension


def gray(rgb: np.ndarray) -> np.ndarray:
    """The grey image the flow is measured on: FLOW_SCALE times smaller than `rgb`."""
    h, w = rgb.shape[:2]
    small = cv2.resize(rgb, (max(1, w // FLOW_SCALE), max(1, h // FLOW_SCALE)), interpolation=cv2.INTER_AREA)
    return cv2.cvtColor(small, cv2.COLOR_RGB2GRAY)


def warp_previous(prev_out: np.ndarray, prev_in_gray: np.ndarray, frame: np.ndarray) -> np.ndarray:
    """prev_out uint8 [H, W, 3] moved by the flow from the previous input (`gray` of it) to `frame`
    (uint8 RGB [H, W, 3])."""
    h, w = prev_out.shape[:2]
    small = cv2.calcOpticalFlowFarneback(prev_in_gray, gray(frame), None, **FARNEBACK)
    flow = cv2.resize(small, (w, h), interpolation=cv2.INTER_LINEAR)
    flow[..., 0] *= w / small.shape[1]
    flow[..., 1] *= h / small.shape[0]
    xs, ys = _pixel_grid(h, w)
    return cv2.remap(prev_out, xs - flow[..., 0], ys - flow[..., 1], cv2.INTER_LINEAR,
                     borderMode=cv2.BORDER_REPLICATE)


@lru_cache(maxsize=4)
def _pixel_grid(h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Each pixel's x and y, built once per frame size (every frame of a stream has the same); read-only,
    since the flow's worker threads share them."""
    xs, ys = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
    xs.flags.writeable = ys.flags.writeable = False
    return xs, ys


def warp_batch(prev_out: np.ndarray, prev_in: np.ndarray, frames: np.ndarray, pool: Executor) -> np.ndarray:
    """One condition image per frame of the batch, frames in parallel on `pool`."""
    prev_gray = gray(prev_in)
    return np.stack(list(pool.map(lambda f: warp_previous(prev_out, prev_gray, f), frames)))
