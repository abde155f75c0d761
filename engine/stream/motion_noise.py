"""Motion-aware noise: the more the scene moves, the less noise the first step adds.

StreamDiffusionV2's controller. From a chunk's frames in [-1, 1] and the previous chunk's last
frame, d = clamp(max_t RMS(x_t - x_{t-1}) / MOTION_NORM, 0, 1); the running scale
s = (s_init - MOTION_SLOPE * d) * ema + s_prev * (1 - ema); the first timestep t0 = 1000 s - 100.
Fast motion gets a lower t0, so the output follows the input instead of hallucinating.

Optical-flow estimators (OpenCV Farneback or DIS on downscaled grey frames) are offered behind
the same interface; they run on a worker thread so the frame loop never waits for them: a chunk
uses the newest finished estimate, which lags by at most one chunk.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from loom_live.host_bridge.wire.params import MOTION_AWARE, NOISE_SCALE

MOTION_NORM = 0.2  # RMS frame difference (in [-1, 1] units) that counts as full motion
MOTION_SLOPE = 0.1  # how much full motion lowers the noise scale
STEP_OFFSET = 100  # t0 = 1000 * s - STEP_OFFSET
FLOW_NORM_PX = 8.0  # mean flow magnitude (pixels at FLOW_WIDTH) that counts as full motion
FLOW_WIDTH = 160  # frames are downscaled to this width before optical flow
FLOW_MAX_HEIGHT = 4 * FLOW_WIDTH  # ...and at most this height (a frame 2000 px tall and 1 px wide is not
# scaled to 320000 rows: the aspect of frames taller than 4:1 is not kept)


def frame_difference_motion(frames: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """d in [0, 1] from frames [T, 3, H, W] in [-1, 1] (and the previous chunk's last frame).

    Returns a 0-dim tensor on the frames' device, so the caller never syncs the host.
    """
    seq = frames if previous is None else torch.cat([previous[None], frames])
    if seq.shape[0] < 2:
        return torch.zeros((), device=frames.device)
    diff = (seq[1:].float() - seq[:-1].float()).pow(2).mean(dim=(1, 2, 3)).sqrt()
    return (diff.max() / MOTION_NORM).clamp(0.0, 1.0)


class OpticalFlowMotion:
    """Flow-magnitude motion estimate computed on a worker thread, off the critical path."""

    def __init__(self, method: str = "dis") -> None:
        import cv2

        if method not in ("dis", "farneback"):
            raise ValueError(f"optical flow method {method!r} is not allowed; expected 'dis' or 'farneback'")
        self.method = method
        self._cv2 = cv2
        self._dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_ULTRAFAST) if method == "dis" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-flow")
        self._pending: Future | None = None
        self._latest = 0.0
        self._lock = threading.Lock()

    def submit(self, frames_u8: np.ndarray, previous_u8: np.ndarray | None) -> None:
        """Queue an estimate for these uint8 RGB frames [T, H, W, 3]; skipped while one is running."""
        if self._pending is not None and not self._pending.done():
            return
        frames_u8, previous_u8 = _host(frames_u8), _host(previous_u8)  # device frames: one small copy
        seq = frames_u8 if previous_u8 is None else np.concatenate([previous_u8[None], frames_u8])
        self._pending = self._pool.submit(self._estimate, seq.copy())

    def latest(self) -> float:
        """The newest finished estimate in [0, 1] (0 until the first one finishes)."""
        if self._pending is not None and self._pending.done():
            with self._lock:
                self._latest = float(self._pending.result())
        return self._latest

    def _estimate(self, seq: np.ndarray) -> float:
        cv2 = self._cv2
        h, w = seq.shape[1:3]
        size = (FLOW_WIDTH, min(max(8, round(h * FLOW_WIDTH / w)), FLOW_MAX_HEIGHT))
        grey = [cv2.cvtColor(cv2.resize(f, size, interpolation=cv2.INTER_AREA), cv2.COLOR_RGB2GRAY) for f in seq]
        worst = 0.0
        for a, b in zip(grey, grey[1:]):
            if self._dis is not None:
                flow = self._dis.calc(a, b, None)
            else:
                flow = cv2.calcOpticalFlowFarneback(a, b, None, 0.5, 3, 15, 3, 5, 1.2, 0)
            worst = max(worst, float(np.linalg.norm(flow, axis=2).mean()))
        return min(worst / FLOW_NORM_PX, 1.0)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _host(frames: np.ndarray | torch.Tensor | None) -> np.ndarray | None:
    return frames.cpu().numpy() if isinstance(frames, torch.Tensor) else frames


class MotionNoiseController:
    """Keeps the running noise scale s and turns it into the first step index t0."""

    def __init__(self, noise_scale: float = NOISE_SCALE.default, ema: float = 0.9, enabled: bool = MOTION_AWARE.default,
                 estimator: str = "frame_diff") -> None:
        self.noise_scale = noise_scale
        self.ema = ema
        self.enabled = enabled
        self.estimator = estimator
        self._flow = OpticalFlowMotion(estimator) if estimator != "frame_diff" else None
        self.reset()

    def set_noise(self, noise_scale: float, enabled: bool) -> None:
        """New base noise scale and motion switch; the running scale moves towards it chunk by chunk."""
        self.noise_scale, self.enabled = noise_scale, enabled

    def reset(self) -> None:
        self._scale: torch.Tensor | float = self.noise_scale
        self.last_motion: torch.Tensor | float = 0.0
        self._telemetry: torch.Tensor | None = None

    def update(self, frames: torch.Tensor, previous: torch.Tensor | None,
               frames_u8: np.ndarray | None = None, previous_u8: np.ndarray | None = None) -> torch.Tensor | float:
        """Advance the controller by one chunk; returns the new scale s (tensor or float)."""
        if not self.enabled:  # and the stats say so: the last motion-aware values would stay on show
            self._scale, self.last_motion, self._telemetry = self.noise_scale, 0.0, None
            return self._scale
        if self._flow is not None:
            if frames_u8 is not None:
                self._flow.submit(frames_u8, previous_u8)
            d: torch.Tensor | float = self._flow.latest()
        else:
            d = frame_difference_motion(frames, previous)
        return self.advance(d)

    def advance(self, d: torch.Tensor | float) -> torch.Tensor | float:
        """Advance by one chunk whose motion estimate d in [0, 1] is known (the training recipe
        precomputes it); returns the new scale s."""
        self.last_motion = d
        self._scale = (self.noise_scale - MOTION_SLOPE * d) * self.ema + self._scale * (1.0 - self.ema)
        if isinstance(self._scale, torch.Tensor) and self._scale.is_cuda:
            # Telemetry copy without a host sync: read later, at most a chunk old.
            if self._telemetry is None:
                self._telemetry = torch.zeros(2, pin_memory=True)
            values = torch.stack([self._scale.float(), torch.as_tensor(d, device=self._scale.device).float()])
            self._telemetry.copy_(values, non_blocking=True)
        return self._scale

    @property
    def scale(self) -> torch.Tensor | float:
        return self._scale

    def telemetry(self) -> tuple[float, float]:
        """(noise scale, motion) as floats for stats; never waits for the GPU."""
        if self._telemetry is not None:
            scale, motion = self._telemetry.tolist()
            return scale, motion
        return float(self._scale), float(self.last_motion)

    @staticmethod
    def first_step(scale: torch.Tensor | float) -> torch.Tensor | float:
        """t0 = 1000 s - 100 (a step index, not yet shifted)."""
        return 1000.0 * scale - STEP_OFFSET

    def close(self) -> None:
        if self._flow is not None:
            self._flow.close()
