"""Control frames for VACE: the structure the model keeps, made from the input or given beside it.

One mechanism for every host: a control source turns the stream's model-size frames ([-1, 1] on the
compute device) into control frames of the same shape, which the control latents are encoded from
(engine/stream/control_latents.py). Sources, chosen live by `control_source`:
- edges: Canny edges at the model size, white on black: on a GPU in tensor operations (canny.py:
  nothing waits for the device), on a CPU with OpenCV; the same edges;
- grey: the luma, on the device;
- flow: dense optical flow from the previous frame (OpenCV DIS) as a colour wheel: hue the
  direction, brightness the speed;
- depth: a depth-estimation model the user pulled (transformers `AutoModelForDepthEstimation`, e.g.
  Depth Anything V2 small), near bright; loaded at start and refused there with one line when absent;
- video: frames the host gives with the input (`StreamSession.push(frames, control=...)`) or a
  video file (`control.video`), mapped to the model size like the input.
A given control video of the wrong size or length is refused and counted; those frames, and frames the
video source gets no control frame for, fall back to the grey source (counted as missing), and the
stream goes on.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from loom_live.engine.layers.image_kernels import luma
from loom_live.engine.stream.canny import DEVICE_STEPS, canny
from loom_live.host_bridge.wire.params import CONTROL_SOURCES

log = logging.getLogger(__name__)

CANNY_LOW, CANNY_HIGH = 100, 200
FLOW_FULL_SPEED = 0.05  # flow magnitude, as a fraction of the frame diagonal, shown at full brightness


class ControlFrames:
    """Makes control frames for a chunk; keeps what a source needs between chunks (the previous frame
    for flow, the open control video). One per stream; `reset()` starts a new stream."""

    def __init__(self, device: torch.device, depth_model: str | None = None, video: str | None = None,
                 fused: bool = False) -> None:
        self.device = device
        self.fused = fused  # the device Canny's hysteresis compiled (CUDA, needs triton)
        self.depth = DepthEstimator(depth_model, device) if depth_model else None
        self.video = ControlVideoFile(video) if video else None
        self._dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_ULTRAFAST)
        self._prev_grey: np.ndarray | None = None
        self.refused = 0  # host control frames refused (wrong size or count), for the stats
        self.missing = 0  # frames of the video source that came without a control frame (nor a control file)

    def reset(self) -> None:
        self._prev_grey = None
        if self.video is not None:
            self.video.rewind()

    def check_source(self, source: str) -> None:
        """ValueError, one line, for a source this stream cannot make (before it is switched to)."""
        if source not in CONTROL_SOURCES:
            raise ValueError(f"control_source: {source!r} is not allowed; expected one of {', '.join(CONTROL_SOURCES)}")
        if source == "depth" and self.depth is None:
            raise ValueError("control_source: 'depth' needs a depth model given at start (control.depth_model=PATH)")

    def accept(self, given: np.ndarray | torch.Tensor, frames: np.ndarray | torch.Tensor) -> Any:
        """The host's control frames for the input `frames` (uint8 [N, H, W, 3]) as uint8 frames, or None
        when they do not fit: wrong dtype, size or count is refused with one logged line and counted."""
        from loom_live.engine.stream.frames import FrameError, validate_frames

        try:
            good, dropped = validate_frames(given)
        except FrameError as exc:
            return self._refuse(len(frames), f"control frames refused: {exc}")
        if dropped:
            return self._refuse(len(frames), f"control frames refused: {dropped} of the {len(given)} hold NaN or "
                                             f"infinity; float control frames are taken as 0..1, finite")
        if len(good) != len(frames):
            return self._refuse(len(frames), f"control frames refused: {len(given)} control frames for "
                                             f"{len(frames)} input frames; give one per input frame")
        if tuple(good.shape[1:3]) != tuple(frames.shape[1:3]):
            return self._refuse(len(frames), f"control frames refused: {good.shape[2]}x{good.shape[1]}; the input "
                                             f"is {frames.shape[2]}x{frames.shape[1]} and the control must match it")
        return good

    def _refuse(self, count: int, why: str) -> None:
        self.refused += count
        log.warning("%s (the grey source stands in; the stream goes on)", why)
        return None

    def make(self, source: str, x: torch.Tensor, given: torch.Tensor | None = None) -> torch.Tensor:
        """Control frames [N, 3, H, W] in [-1, 1] for model-size frames x [N, 3, H, W] in [-1, 1].

        `given`: the host's control frames for this chunk, already at the model size (source video);
        None there means none came (or they were refused): the grey source stands in."""
        with torch.no_grad():
            if source != "flow":
                self._prev_grey = None  # flow restarts from the next frame when it is switched back on
            if source == "video":
                if given is None and self.video is not None:
                    given = self.video.next(len(x), x.shape[2:], x.device, x.dtype)
                if given is None:
                    self.missing += len(x)
                return given if given is not None else grey(x)
            return {"grey": grey, "edges": self._edges, "flow": self._flow,
                    "depth": lambda t: self.depth(t)}[source](x)

    def _edges(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            edges = canny(_grey_levels(x), CANNY_LOW, CANNY_HIGH, steps=DEVICE_STEPS, fused=self.fused)
            return (edges.to(x.dtype) * 2.0 - 1.0)[:, None].expand(-1, 3, -1, -1).contiguous()
        edges = [cv2.Canny(g, CANNY_LOW, CANNY_HIGH) for g in _grey_u8(x)]
        return _to_model(np.stack(edges)[..., None].repeat(3, -1), x)

    def _flow(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        for g in _grey_u8(x):
            prev = self._prev_grey if self._prev_grey is not None else g
            out.append(flow_colours(self._dis.calc(prev, g, None)))
            self._prev_grey = g
        return _to_model(np.stack(out), x)


def grey(x: torch.Tensor) -> torch.Tensor:
    """The luma of frames [N, 3, H, W] in [-1, 1], as three equal channels."""
    return (x * luma(x.device, x.dtype)).sum(1, keepdim=True).expand_as(x).contiguous()


def flow_colours(flow: np.ndarray) -> np.ndarray:
    """Optical flow [H, W, 2] as RGB uint8: hue the direction, value the speed (full at FLOW_FULL_SPEED)."""
    h, w = flow.shape[:2]
    mag, ang = cv2.cartToPolar(flow[..., 0], flow[..., 1])
    hsv = np.empty((h, w, 3), np.uint8)
    hsv[..., 0] = (ang * (90.0 / np.pi)).astype(np.uint8)  # OpenCV hue is 0..179
    hsv[..., 1] = 255
    hsv[..., 2] = np.clip(mag / (FLOW_FULL_SPEED * np.hypot(h, w)) * 255.0, 0, 255).astype(np.uint8)
    return cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)


def _grey_levels(x: torch.Tensor) -> torch.Tensor:
    """The luma of frames [N, 3, H, W] in [-1, 1] as whole grey levels 0..255 (float32 [N, H, W])."""
    return ((grey(x)[:, 0].float() + 1.0) * 127.5).round().clamp(0, 255)


def _grey_u8(x: torch.Tensor) -> list[np.ndarray]:
    g = _grey_levels(x).to(torch.uint8)
    return list(g.cpu().numpy())


def _to_model(rgb_u8: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(rgb_u8)).to(like.device).permute(0, 3, 1, 2)
    return (t.to(like.dtype) / 127.5 - 1.0).contiguous()


class DepthEstimator:
    """A transformers depth model from a local directory, run on the stream's device; near is bright."""

    def __init__(self, path: str, device: torch.device) -> None:
        where = Path(path).expanduser()
        if not where.is_dir():
            raise ValueError(f"control.depth_model: {where} is not a directory; give a depth-estimation model "
                             "folder (e.g. Depth Anything V2 small for transformers, config.json + weights)")
        try:
            from transformers import AutoModelForDepthEstimation
        except ImportError:
            raise ValueError("control.depth_model: the depth source needs transformers (pip install "
                             "'loom-live[t5]')") from None
        try:
            self.model = AutoModelForDepthEstimation.from_pretrained(str(where)).to(device).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"control.depth_model: {where} is not a depth-estimation model transformers can "
                             f"load ({str(exc).splitlines()[0][:160]})") from None
        self.patch = int(getattr(self.model.config, "patch_size", 14) or 14)
        self.mean = torch.tensor((0.485, 0.456, 0.406), device=device)[None, :, None, None]
        self.std = torch.tensor((0.229, 0.224, 0.225), device=device)[None, :, None, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[2:]
        side = lambda n: max(self.patch, round(n / self.patch) * self.patch)  # noqa: E731
        pixels = torch.nn.functional.interpolate((x.float() + 1) / 2, size=(side(h), side(w)), mode="bilinear",
                                                 align_corners=False)
        depth = self.model(pixel_values=(pixels - self.mean) / self.std).predicted_depth[:, None]
        depth = torch.nn.functional.interpolate(depth, size=(h, w), mode="bilinear", align_corners=False)
        lo, hi = depth.amin((2, 3), keepdim=True), depth.amax((2, 3), keepdim=True)
        return ((depth - lo) / (hi - lo).clamp_min(1e-6) * 2 - 1).expand(-1, 3, -1, -1).to(x.dtype).contiguous()


class ControlVideoFile:
    """A control video read frame by frame beside the input (control.video), looping at its end.

    Its frames must have the model's aspect; they are resized to the model size."""

    def __init__(self, path: str) -> None:
        self.path = Path(path).expanduser()
        if not self.path.exists():
            raise ValueError(f"control.video: {self.path}: no such file")
        self._cap = cv2.VideoCapture(str(self.path))
        if not self._cap.isOpened():
            raise ValueError(f"control.video: {self.path} cannot be opened as a video")

    def rewind(self) -> None:
        self._cap.set(cv2.CAP_PROP_POS_FRAMES, 0)

    def next(self, count: int, size: Any, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        frames = []
        for _ in range(count):
            ok, bgr = self._cap.read()
            if not ok:
                self.rewind()
                ok, bgr = self._cap.read()
                if not ok:
                    log.warning("control.video: %s yields no frames; the grey source stands in", self.path)
                    return None
            frames.append(cv2.resize(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), (int(size[1]), int(size[0])),
                                     interpolation=cv2.INTER_AREA))
        t = torch.from_numpy(np.stack(frames)).to(device).permute(0, 3, 1, 2)
        return (t.to(dtype) / 127.5 - 1.0).contiguous()
