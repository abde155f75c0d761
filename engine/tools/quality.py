"""Temporal quality of a restyled stream: warp error, flicker and drift over long runs.

Why these numbers: the streaming mechanisms (sinks, RoPE refresh, motion-aware noise, the
scheduler) exist to keep a restyled video stable over time. Stability is judged against the
input's own motion: optical flow is computed on the INPUT frames (classic OpenCV flow, no
learned weights), output frame t+1 is warped back onto output frame t along it, and what is
left over is the warp error (lower is steadier). Flicker is how much more the output changes
from frame to frame than the input does. Both are kept per window of frames along the stream,
so a slow degradation over thousands of frames shows as a trend, and drawn as a PNG (matplotlib).
Sharpness (mean Sobel gradient) is kept beside them: a blurred output is steady too.

``QualityMeter`` takes (input, output) pairs one at a time and keeps only the previous pair,
so a 3,000-frame run needs no frame storage.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np

REPORT_VERSION = 1
DEFAULT_WINDOW = 100
FLOW_METHODS = ("farneback", "dis", "none")
FARNEBACK_PARAMS = {"pyr_scale": 0.5, "levels": 3, "winsize": 15, "iterations": 3, "poly_n": 5,
                    "poly_sigma": 1.2}
DIS_PRESET = "medium"
_DIS_PRESETS = {"ultrafast": cv2.DISOPTICAL_FLOW_PRESET_ULTRAFAST, "fast": cv2.DISOPTICAL_FLOW_PRESET_FAST,
                "medium": cv2.DISOPTICAL_FLOW_PRESET_MEDIUM}
# Forward-backward consistency (Sundaram, Brox and Keutzer 2010): a pixel is occluded when
# |F + B(p+F)|^2 > OCCLUSION_ALPHA * (|F|^2 + |B(p+F)|^2) + OCCLUSION_BETA, or leaves the frame.
OCCLUSION_ALPHA = 0.01
OCCLUSION_BETA = 0.5
# Per-window columns of a report, in this order; all but the occlusion column are always floats.
WINDOW_METRICS = ("warp_error", "flicker", "output_diff", "input_diff", "occluded_fraction",
                  "luma_shift", "saturation_shift", "contrast_ratio", "sharpness", "input_sharpness")
PLOT_METRICS = ("warp_error", "sharpness", "flicker", "luma_shift", "saturation_shift")
METRIC_LABELS = {
    "warp_error": "warp error (0..255, lower is steadier)",
    "flicker": "flicker (output change - input change)",
    "output_diff": "output frame-to-frame change",
    "input_diff": "input frame-to-frame change",
    "occluded_fraction": "occluded fraction",
    "luma_shift": "luma shift (output - input)",
    "saturation_shift": "saturation shift (output - input)",
    "contrast_ratio": "contrast ratio (output / input)",
    "sharpness": "sharpness (mean Sobel gradient of the output's luma; higher is crisper)",
    "input_sharpness": "input sharpness (mean Sobel gradient of the input's luma)",
}


class FlowEstimator:
    """Dense optical flow between two grayscale frames, forward: prev(p) ~ next(p + flow(p))."""

    def __init__(self, method: str = "farneback"):
        if method not in FLOW_METHODS:
            raise ValueError(f"flow method {method!r} is not one of {', '.join(FLOW_METHODS)}")
        self.method = method
        self._dis = cv2.DISOpticalFlow_create(_DIS_PRESETS[DIS_PRESET]) if method == "dis" else None

    @property
    def params(self) -> dict[str, Any]:
        """What the report records about the flow, enough to reproduce it."""
        if self.method == "farneback":
            return {"method": "farneback", **FARNEBACK_PARAMS}
        if self.method == "dis":
            return {"method": "dis", "preset": DIS_PRESET}
        return {"method": "none"}

    def __call__(self, prev_gray: np.ndarray, next_gray: np.ndarray) -> np.ndarray:
        if self.method == "none" or np.array_equal(prev_gray, next_gray):
            # Nothing moved (or no compensation asked for): exactly zero, and no time spent.
            return np.zeros((*prev_gray.shape, 2), np.float32)
        if self.method == "farneback":
            p = FARNEBACK_PARAMS
            return cv2.calcOpticalFlowFarneback(prev_gray, next_gray, None, p["pyr_scale"], p["levels"],
                                                p["winsize"], p["iterations"], p["poly_n"],
                                                p["poly_sigma"], 0)
        return self._dis.calc(prev_gray, next_gray, None)


def warp_back(frame: np.ndarray, flow: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Sample ``frame`` (time t+1) at p + flow(p): the result lines up with time t."""
    maps = grid + flow
    return cv2.remap(frame, maps[..., 0], maps[..., 1], cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)


def consistent_flow_mask(forward: np.ndarray, backward: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """True where forward and backward flow agree and p + flow(p) stays inside the frame."""
    back_at_target = warp_back(backward, forward, grid)
    mismatch = np.sum((forward + back_at_target) ** 2, axis=-1)
    magnitude = np.sum(forward**2, axis=-1) + np.sum(back_at_target**2, axis=-1)
    target = grid + forward
    height, width = forward.shape[:2]
    inside = (target[..., 0] >= 0) & (target[..., 0] <= width - 1) & (target[..., 1] >= 0) \
        & (target[..., 1] <= height - 1)
    return inside & (mismatch <= OCCLUSION_ALPHA * magnitude + OCCLUSION_BETA)


@dataclass
class QualityReport:
    """Result of a run; ``to_json`` gives the documented schema (``version`` REPORT_VERSION).

    ``windows`` holds one list per column (``start_frame``, ``end_frame`` exclusive, ``pairs``,
    then WINDOW_METRICS), one entry per window. ``trend`` maps each metric to its least-squares
    ``slope_per_1000_frames`` over the windows and its ``first`` and ``last`` window values
    (slope None with fewer than two windows). ``occluded_fraction`` is None without the mask.
    """

    mode: str
    flow: dict[str, Any]
    window: int
    frames: int
    pairs: int
    width: int
    height: int
    totals: dict[str, float | None]
    windows: dict[str, list]
    trend: dict[str, dict[str, float | None]]
    meta: dict[str, Any] = field(default_factory=dict)
    version: int = REPORT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text


class _Sums:
    """Running sums of the per-pair and per-frame measurements of one window (or of the run)."""

    def __init__(self, start_frame: int):
        self.start_frame = start_frame
        self.end_frame = start_frame
        self.pairs = 0
        self.frames = 0
        self.sums = dict.fromkeys(WINDOW_METRICS, 0.0)

    def add_pair(self, values: dict[str, float]) -> None:
        self.pairs += 1
        for key, value in values.items():
            self.sums[key] += value

    def add_frame(self, index: int, values: dict[str, float]) -> None:
        self.frames += 1
        self.end_frame = index + 1
        for key, value in values.items():
            self.sums[key] += value

    def means(self, occlusion: bool) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for key, total in self.sums.items():
            per_frame = key in _FRAME_METRICS
            count = self.frames if per_frame else self.pairs
            out[key] = total / count if count else None
        if not occlusion:
            out["occluded_fraction"] = None
        return out


_FRAME_METRICS = ("luma_shift", "saturation_shift", "contrast_ratio", "sharpness", "input_sharpness")


class QualityMeter:
    """Streaming accumulator: ``update(input, output)`` per frame, ``report()`` at any time.

    Frames are uint8 RGB ``[H, W, 3]``; input and output of a pair have the same size and the
    size stays fixed along the stream. Memory is constant: the previous pair and the sums.
    """

    def __init__(self, flow: str = "farneback", occlusion: bool = False, window: int = DEFAULT_WINDOW):
        if not isinstance(window, int) or window < 2:
            raise ValueError(f"window must be an integer >= 2 frames, got {window!r}")
        if occlusion and flow == "none":
            raise ValueError("the occlusion mask needs a flow method (farneback or dis), not 'none'")
        self.flow = FlowEstimator(flow)
        self.occlusion = occlusion
        self.window = window
        self.reset()

    @property
    def mode(self) -> str:
        return self.flow.method + ("+occlusion" if self.occlusion else "")

    @property
    def frames(self) -> int:
        return self._frames

    def reset(self) -> None:
        self._frames = 0
        self._shape: tuple[int, ...] | None = None
        self._prev: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # input, output, input gray
        self._grid: np.ndarray | None = None
        self._total = _Sums(0)
        self._closed: list[_Sums] = []
        self._current = _Sums(0)

    def update(self, input_frame: np.ndarray, output_frame: np.ndarray) -> None:
        """Add frame ``frames`` of the stream: the engine's input and its output for it."""
        index = self._frames
        _check_frame(input_frame, f"input frame {index}")
        _check_frame(output_frame, f"output frame {index}")
        if input_frame.shape != output_frame.shape:
            raise ValueError(f"frame {index}: input {_size(input_frame)} and output {_size(output_frame)} "
                             "differ in size; resize one to the other before measuring")
        if self._shape is None:
            self._shape = input_frame.shape
            height, width = input_frame.shape[:2]
            self._grid = np.dstack(np.meshgrid(np.arange(width, dtype=np.float32),
                                               np.arange(height, dtype=np.float32)))
        elif input_frame.shape != self._shape:
            raise ValueError(f"frame {index}: size {_size(input_frame)} differs from the stream's "
                             f"{self._shape[1]}x{self._shape[0]}; a stream keeps one size")
        if index and index % self.window == 0:
            self._closed.append(self._current)
            self._current = _Sums(index)
        gray = cv2.cvtColor(input_frame, cv2.COLOR_RGB2GRAY)
        if self._prev is not None:
            values = self._pair_values(*self._prev, input_frame, output_frame, gray)
            self._current.add_pair(values)
            self._total.add_pair(values)
        stats = _frame_stats(input_frame, output_frame)
        self._current.add_frame(index, stats)
        self._total.add_frame(index, stats)
        # Copies: callers (cameras, engine output rings) may reuse their buffers for the next frame.
        self._prev = (input_frame.copy(), output_frame.copy(), gray)
        self._frames += 1

    def _pair_values(self, in0: np.ndarray, out0: np.ndarray, gray0: np.ndarray, in1: np.ndarray,
                     out1: np.ndarray, gray1: np.ndarray) -> dict[str, float]:
        forward = self.flow(gray0, gray1)
        error = np.abs(out0.astype(np.float32) - warp_back(out1, forward, self._grid)).mean(axis=-1)
        values = {"input_diff": _mean_abs_diff(in1, in0), "output_diff": _mean_abs_diff(out1, out0)}
        values["flicker"] = values["output_diff"] - values["input_diff"]
        if self.occlusion:
            valid = consistent_flow_mask(forward, self.flow(gray1, gray0), self._grid)
            values["occluded_fraction"] = 1.0 - float(valid.mean())
            # A pair with every pixel occluded (a scene cut) has nothing to compare: it adds 0.
            values["warp_error"] = float(error[valid].mean()) if valid.any() else 0.0
        else:
            values["warp_error"] = float(error.mean())
        return values

    def report(self, meta: dict[str, Any] | None = None) -> QualityReport:
        """The report so far (the meter keeps running). Needs at least two frames."""
        if self._frames < 2:
            raise ValueError(f"need at least 2 frames to measure temporal quality, got {self._frames}: "
                             "warp error and flicker compare consecutive frames")
        windows = [w for w in (*self._closed, self._current) if w.frames]
        columns: dict[str, list] = {"start_frame": [w.start_frame for w in windows],
                                    "end_frame": [w.end_frame for w in windows],
                                    "pairs": [w.pairs for w in windows]}
        means = [w.means(self.occlusion) for w in windows]
        for key in WINDOW_METRICS:
            columns[key] = [m[key] for m in means]
        centres = [(w.start_frame + w.end_frame - 1) / 2 for w in windows]
        weights = [max(w.pairs, 1) for w in windows]
        trend = {key: _trend(centres, columns[key], weights) for key in WINDOW_METRICS}
        height, width = self._shape[:2]
        return QualityReport(mode=self.mode, flow=self.flow.params, window=self.window, frames=self._frames,
                             pairs=self._total.pairs, width=width, height=height,
                             totals=self._total.means(self.occlusion), windows=columns, trend=trend,
                             meta=dict(meta or {}))


def evaluate_frames(inputs: Sequence[np.ndarray] | np.ndarray, outputs: Sequence[np.ndarray] | np.ndarray,
                    flow: str = "farneback", occlusion: bool = False,
                    window: int = DEFAULT_WINDOW) -> QualityReport:
    """Measure a whole clip held in memory: ``inputs[i]`` is what produced ``outputs[i]``."""
    if len(inputs) != len(outputs):
        raise ValueError(f"inputs and outputs must have the same number of frames, got {len(inputs)} "
                         f"and {len(outputs)}")
    meter = QualityMeter(flow=flow, occlusion=occlusion, window=window)
    for input_frame, output_frame in zip(inputs, outputs):
        meter.update(input_frame, output_frame)
    return meter.report()


def _check_frame(frame: Any, what: str) -> None:
    if not isinstance(frame, np.ndarray):
        raise ValueError(f"{what} must be a numpy array, got {type(frame).__name__}")
    if frame.dtype != np.uint8:
        raise ValueError(f"{what} must be uint8 (0..255), got {frame.dtype}")
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.shape[0] < 2 or frame.shape[1] < 2:
        raise ValueError(f"{what} must be RGB [H, W, 3] with H, W >= 2, got shape {frame.shape}")


def _size(frame: np.ndarray) -> str:
    return f"{frame.shape[1]}x{frame.shape[0]}"


def _mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(cv2.absdiff(a, b).mean())


def _frame_stats(input_frame: np.ndarray, output_frame: np.ndarray) -> dict[str, float]:
    """Colour drift of the output relative to its input: luma, saturation (0..255), contrast; and sharpness."""
    stats = []
    for frame in (input_frame, output_frame):
        luma = cv2.cvtColor(frame, cv2.COLOR_RGB2GRAY)
        saturation = cv2.cvtColor(frame, cv2.COLOR_RGB2HSV)[..., 1]
        stats.append((float(luma.mean()), float(saturation.mean()), float(luma.std()), sobel_sharpness(luma)))
    (in_luma, in_sat, in_std, in_sharp), (out_luma, out_sat, out_std, out_sharp) = stats
    # +1 level on both sides keeps the ratio finite and near 1 on flat (black, blank) inputs.
    return {"luma_shift": out_luma - in_luma, "saturation_shift": out_sat - in_sat,
            "contrast_ratio": (out_std + 1.0) / (in_std + 1.0), "sharpness": out_sharp, "input_sharpness": in_sharp}


def sobel_sharpness(luma: np.ndarray) -> float:
    """Mean Sobel gradient magnitude (0..~1442 on 0..255 luma): a steady but blurred output scores a low
    warp error too, so sharpness is reported beside it to tell stability from smearing."""
    gx = cv2.Sobel(luma, cv2.CV_32F, 1, 0, ksize=3)
    gy = cv2.Sobel(luma, cv2.CV_32F, 0, 1, ksize=3)
    return float(cv2.magnitude(gx, gy).mean())


def _trend(x: list[float], y: list[float | None], weights: list[int]) -> dict[str, float | None]:
    points = [(xi, yi, wi) for xi, yi, wi in zip(x, y, weights) if yi is not None]
    first = points[0][1] if points else None
    last = points[-1][1] if points else None
    slope = None
    if len(points) >= 2:
        xs, ys, ws = (np.array(v, np.float64) for v in zip(*points))
        slope = float(np.polyfit(xs, ys, 1, w=np.sqrt(ws))[0] * 1000.0)
    return {"slope_per_1000_frames": slope, "first": first, "last": last}


# ----------------------------------------------------------------------------------------------
# Plot (matplotlib: the `eval` extra)

PLOT_SIZE_INCHES = (10.0, 2.4)  # width, height per panel
PLOT_DPI = 100
# Smallest y range a panel shows (default 1.0 level of 0..255), so noise is not blown up.
_MIN_SPAN = {"contrast_ratio": 0.1, "occluded_fraction": 0.1}


def can_plot() -> bool:
    """Whether `plot_reports` can draw here (matplotlib loads): `loom eval` writes no plot without it, so an
    earlier PNG of the same name is not among the files it would replace."""
    try:
        _pyplot()
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        from matplotlib import pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'loom-live[eval]'") from exc
    return plt


def plot_reports(runs: Sequence[tuple[str, QualityReport]], path: str | Path, title: str = "",
                 metrics: Sequence[str] = PLOT_METRICS) -> Path:
    """Draw the per-window metrics of one or more runs (one line each, one panel per metric) into a PNG."""
    if not runs:
        raise ValueError("plot_reports needs at least one (label, report) run")
    unknown = [m for m in metrics if m not in WINDOW_METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; allowed: {', '.join(WINDOW_METRICS)}")
    plt = _pyplot()
    metrics = [m for m in metrics if any(v is not None for _, r in runs for v in r.windows[m])]
    width, panel = PLOT_SIZE_INCHES
    fig, axes = plt.subplots(len(metrics), 1, figsize=(width, panel * len(metrics) + 0.8), sharex=True,
                             squeeze=False, dpi=PLOT_DPI)
    try:
        for ax, metric in zip(axes[:, 0], metrics):
            for label, report in runs:
                xs, ys = _series(report, metric)
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
            lo, hi = ax.get_ylim()
            span = _MIN_SPAN.get(metric, 1.0)
            if hi - lo < span:
                mid = (hi + lo) / 2
                ax.set_ylim(mid - span / 2, mid + span / 2)
            ax.set_title(METRIC_LABELS[metric], fontsize=9, loc="left")
            ax.grid(True, alpha=0.3)
        axes[-1, 0].set_xlabel("frame (window centre)")
        axes[0, 0].legend(loc="upper right", fontsize=8)
        fig.suptitle(title or "Loom temporal quality", fontsize=11)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return Path(path)


def _series(report: QualityReport, metric: str) -> tuple[list[float], list[float]]:
    """(window centre frame, value) of every window that has the metric."""
    w = report.windows
    points = [((start + end - 1) / 2, value) for start, end, value in
              zip(w["start_frame"], w["end_frame"], w[metric]) if value is not None]
    return [p[0] for p in points], [p[1] for p in points]
