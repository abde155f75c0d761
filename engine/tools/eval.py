"""`loom eval`'s measuring: frames through a processor (the engine, or none), temporal quality per clip.

Why here: the measuring is engine-side work on arrays; the command (plugin.cli.eval) only opens
files and parses arguments, so frames reach this module as iterables of uint8 RGB arrays and the
engine never imports the hosts. Every run gets a JSON report and one PNG per clip.

The engine is reached through one small function, ``run_clip``; everything else here works on
any object with ``push(frames) -> frames`` and ``flush() -> frames``.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import cv2
import numpy as np

from loom_live.engine.tools.progress import FrameProgress
from loom_live.engine.tools.quality import (
    DEFAULT_WINDOW,
    PLOT_METRICS,
    QualityMeter,
    QualityReport,
    can_plot,
    plot_reports,
)
from loom_live.host_bridge.wire.files import replacing_together

DEFAULT_CHUNK = 4
EVAL_REPORT_VERSION = 2
SUMMARY_METRICS = ("warp_error", "sharpness", "flicker", "output_diff", "luma_shift", "saturation_shift")
AS_IS_PLOT_METRICS = ("warp_error", "sharpness", "output_diff")
# What a file scored as it is (output = input) does not measure: each compares the output with its input,
# so its value would be 0 (1 for the ratio) by construction. The report says null, the table '-'.
INPUT_COMPARISONS = ("flicker", "luma_shift", "saturation_shift", "contrast_ratio")
REPORT_NAME = "report.json"
# A clip of known length is cut into this many windows at least (so its plot has a line, not a point),
# with windows of at most DEFAULT_WINDOW frames.
MIN_WINDOWS = 8


class EvalError(RuntimeError):
    """The engine misbehaved in a way eval can name (lost frames) or is not available."""


class Processor(Protocol):
    """What eval needs from the engine: frames in, the frames that became ready out, in order."""

    def push(self, frames: np.ndarray) -> np.ndarray: ...

    def flush(self) -> np.ndarray: ...


class IdentityProcessor:
    """Output = input: the baseline every restyling pipeline is measured against."""

    def push(self, frames: np.ndarray) -> np.ndarray:
        return frames

    def flush(self) -> np.ndarray:
        return np.empty((0, 0, 0, 3), np.uint8)


@dataclass
class EvalRun:
    """One column of the comparison: a label and how to make a fresh processor for each clip."""

    label: str
    make_processor: Callable[[], Processor]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Clip:
    """A clip to measure: where it comes from, how to get its frames again for every run, and how many
    it has (None when unknown: a stream, or a container that does not say)."""

    name: str
    source: str
    frames: Callable[[], Iterator[np.ndarray]]
    frame_count: int | None = None


@dataclass
class EvalSettings:
    """How to measure; ``window=None`` fits the window to each clip (``fit_window``)."""

    flow: str = "farneback"
    occlusion: bool = False
    window: int | None = None
    chunk: int = DEFAULT_CHUNK
    progress: bool = True


def fit_window(frame_count: int | None) -> int:
    """Frames per window for a clip: at least MIN_WINDOWS windows, each 2..DEFAULT_WINDOW frames."""
    if not frame_count:
        return DEFAULT_WINDOW
    return max(2, min(DEFAULT_WINDOW, frame_count // MIN_WINDOWS))


def one_size(frames: Iterable[np.ndarray], name: str) -> Iterator[np.ndarray]:
    """The clip's frames, all of its first frame's size: a stream whose size changes midway (joined
    segments) is refused naming where, since motion between frames of two sizes has no meaning."""
    first: tuple[int, ...] | None = None
    for i, frame in enumerate(frames):
        if first is None:
            first = frame.shape
        elif frame.shape != first:
            raise ValueError(f"{name}: frame {i} is {frame.shape[1]}x{frame.shape[0]} after {i} frames of "
                             f"{first[1]}x{first[0]}; loom eval measures a clip of one frame size (cut or scale it)")
        yield frame


def run_clip(session: Processor, frames: Iterable[np.ndarray], chunk: int = DEFAULT_CHUNK,
             timing: dict[str, float] | None = None) -> Iterator[np.ndarray]:
    """Push ``frames`` through ``session`` ``chunk`` at a time; yield outputs in order, then the tail.

    ``timing["engine_s"]`` accumulates the time spent inside the session.
    """
    timing = timing if timing is not None else {}
    timing.setdefault("engine_s", 0.0)

    def timed(call: Callable[..., np.ndarray], *args: Any) -> np.ndarray:
        start = time.perf_counter()
        out = call(*args)
        timing["engine_s"] += time.perf_counter() - start
        return out

    batch: list[np.ndarray] = []
    for frame in frames:
        batch.append(frame)
        if len(batch) == chunk:
            yield from timed(session.push, np.stack(batch))
            batch = []
    if batch:
        yield from timed(session.push, np.stack(batch))
    yield from timed(session.flush)


def measure_clip(processor: Processor, frames: Iterable[np.ndarray], settings: EvalSettings,
                 meta: dict[str, Any] | None = None, frame_count: int | None = None,
                 label: str = "loom eval") -> QualityReport:
    """Stream a clip through ``processor`` and measure it; memory is bounded by the engine's lag.

    Output i is paired with input i. When the engine outputs another size than it was given
    (its own resolution), the input is resized to the output's size for the flow and the
    report's meta says so.
    """
    window = settings.window or fit_window(frame_count)
    meter = QualityMeter(flow=settings.flow, occlusion=settings.occlusion, window=window)
    progress = FrameProgress(frame_count, label, quiet=not settings.progress)
    waiting: deque[np.ndarray] = deque()

    def remember(source: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
        for frame in source:
            waiting.append(frame)
            yield frame

    timing: dict[str, float] = {}
    resized_to: list[int] | None = None
    for output in run_clip(processor, remember(frames), settings.chunk, timing):
        if not waiting:
            raise EvalError(f"the engine returned more frames than it was given ({meter.frames + 1})")
        source = waiting.popleft()
        output = np.asarray(output)
        if output.ndim == 3 and source.shape != output.shape:
            resized_to = [output.shape[1], output.shape[0]]
            source = cv2.resize(source, tuple(resized_to), interpolation=cv2.INTER_AREA)
        meter.update(source, output)
        progress.update(1)
    progress.close()
    if waiting:
        raise EvalError(f"the engine returned {meter.frames} frames for {meter.frames + len(waiting)} "
                           "inputs, even after flush()")
    meta = dict(meta or {})
    meta["engine_seconds"] = round(timing["engine_s"], 4)
    meta["engine_fps"] = round(meter.frames / timing["engine_s"], 2) if timing["engine_s"] > 0 else None
    meta["input_resized_to"] = resized_to
    return meter.report(meta)


def evaluate(runs: list[EvalRun], clips: list[Clip], settings: EvalSettings, out_dir: Path,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every run on every clip; write ``report.json`` and one PNG per clip (``output_names``) into
    ``out_dir``, all or none: they are written into a hidden folder there and replace an earlier report's
    files of the same names only once the whole report is done, so a run that fails midway (a clip that
    cannot be read, an engine error, Ctrl-C) leaves the earlier report and its plots as they were."""
    if not runs or not clips:
        raise ValueError("eval needs at least one run and one clip")
    with replacing_together(out_dir, last=REPORT_NAME) as staging:
        report = _measure(runs, clips, settings, staging, log)
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _measure(runs: list[EvalRun], clips: list[Clip], settings: EvalSettings, plot_dir: Path,
             log: Callable[[str], None]) -> dict[str, Any]:
    """The report of every run on every clip, its plots drawn into ``plot_dir`` as each clip is done."""
    clip_entries = []
    for clip, plot_name in zip(clips, plot_names(clips)):
        results: dict[str, QualityReport] = {}
        for run in runs:
            log(f"[eval] {clip.name}: {run.label} ...")
            measured = measure_clip(run.make_processor(), one_size(clip.frames(), clip.name), settings,
                                    meta={"clip": clip.name, "run": run.label},
                                    frame_count=clip.frame_count, label=f"{clip.name}: {run.label}")
            as_is = not run.info.get("restyled", True)
            results[run.label] = _without(measured, INPUT_COMPARISONS) if as_is else measured
        title = f"{clip.name}: " + " vs ".join(results)
        try:
            plot_reports(list(results.items()), plot_dir / plot_name, title=title, metrics=_plot_metrics(runs))
        except ImportError as exc:  # the numbers stand without the picture
            log(f"[eval] no plot: {exc}")
            plot_name = None
        clip_entries.append({"clip": clip.name, "source": clip.source, "plot": plot_name,
                             "results": {label: report.to_dict() for label, report in results.items()}})
    return {
        "version": EVAL_REPORT_VERSION,
        "tool": "loom eval",
        "settings": {"flow": settings.flow, "occlusion": settings.occlusion, "window": settings.window or "fit",
                     "chunk": settings.chunk},
        "runs": [{"label": run.label, **run.info} for run in runs],
        "clips": clip_entries,
        "summary": _summary(runs, clip_entries),
    }


def plot_names(clips: list[Clip]) -> list[str]:
    """The PNG each clip's plot is written to, in order: its name's stem, numbered where two share one."""
    taken: set[str] = set()
    return [_unique(f"{Path(clip.name).stem}.png", taken) for clip in clips]


def output_names(clips: list[Clip]) -> list[str]:
    """Every file ``evaluate`` may write into its folder for these clips: the report, then the plots, where it can
    draw them (``evaluate`` writes none without matplotlib)."""
    return [REPORT_NAME, *(plot_names(clips) if can_plot() else [])]


def previous_outputs(out_dir: Path) -> list[Path]:
    """The files an earlier ``loom eval`` wrote into ``out_dir``, as its report lists them (the plots, then
    the report): what an overwriting run removes, so none is left to pass for part of the new report. A
    report.json that is not ``loom eval``'s lists nothing; a listed name that is not a plain PNG in the
    folder (an edited report) is not taken."""
    path = out_dir / REPORT_NAME
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):  # none there, or not a report: nothing it lists
        return []
    if not isinstance(report, dict) or report.get("tool") != "loom eval" or not isinstance(report.get("clips"), list):
        return []
    plots = [clip.get("plot") for clip in report["clips"] if isinstance(clip, dict)]
    listed = [out_dir / name for name in plots
              if isinstance(name, str) and name.endswith(".png") and Path(name).name == name]
    return [p for p in dict.fromkeys(listed) if p.is_file()] + [path]


def _without(report: QualityReport, metrics: tuple[str, ...]) -> QualityReport:
    """The report with ``metrics`` set to None everywhere (totals, windows, trend): not measured."""
    for key in metrics:
        report.totals[key] = None
        report.windows[key] = [None] * len(report.windows[key])
        report.trend[key] = dict.fromkeys(report.trend[key])
    return report


def _plot_metrics(runs: list[EvalRun]) -> tuple[str, ...]:
    """Files scored as they are have no input to differ from: only their own steadiness and sharpness."""
    return PLOT_METRICS if any(run.info.get("restyled", True) for run in runs) else AS_IS_PLOT_METRICS


def _summary(runs: list[EvalRun], clips: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per run: each total averaged over the clips, and the mean warp-error drift slope."""
    summary = {}
    for run in runs:
        reports = [clip["results"][run.label] for clip in clips]
        row: dict[str, float | None] = {}
        for key in SUMMARY_METRICS:
            values = [r["totals"][key] for r in reports if r["totals"][key] is not None]
            row[key] = float(np.mean(values)) if values else None
        slopes = [r["trend"]["warp_error"]["slope_per_1000_frames"] for r in reports]
        slopes = [s for s in slopes if s is not None]
        row["warp_error_slope_per_1000_frames"] = float(np.mean(slopes)) if slopes else None
        summary[run.label] = row
    return summary


def _unique(name: str, taken: set[str]) -> str:
    stem, suffix, n = Path(name).stem, Path(name).suffix, 1
    while name in taken:
        n += 1
        name = f"{stem}_{n}{suffix}"
    taken.add(name)
    return name


def ping_pong(frames: Iterator[np.ndarray], count: int) -> Iterator[np.ndarray]:
    """``count`` frames: the clip, then back and forth over it (kept in memory once) as needed."""
    clip: list[np.ndarray] = []
    for frame in frames:
        if len(clip) == count:
            return
        clip.append(frame)
        yield frame
    if len(clip) < 2:
        raise ValueError(f"a clip needs at least 2 frames to loop, got {len(clip)}")
    cycle = clip[-2:0:-1] + clip  # backwards (ends excluded), then forwards again
    emitted = len(clip)
    while True:
        for frame in cycle:
            if emitted == count:
                return
            emitted += 1
            yield frame


# What each console column means, printed under the table (a newcomer reads numbers without a scale otherwise)
COLUMN_NOTES = (
    "warp err: how much each frame differs from the one before it, moved along the input's motion (optical "
    "flow), 0..255 grey levels; lower is steadier. A soft or blurred output scores low too: read it beside "
    "sharpness",
    "sharpness: mean Sobel gradient of the frames' brightness; higher is crisper (compare clips of one size)",
    "flicker: how much more the output changes from frame to frame than the input does, in grey levels; "
    "0 changes as much as the input, negative changes less (steady, or smoothed), positive flickers. '-' (null "
    "in report.json) for a file scored as it is: there is no input to compare",
    "drift/1k: the trend of warp err per 1,000 frames; positive grows less steady over a long run",
)


def format_notes() -> str:
    """The column notes, one indented line each, for under `format_table`."""
    return "\n".join(f"  {note}" for note in COLUMN_NOTES)


def format_table(report: dict[str, Any]) -> str:
    """The console summary: one line per clip and run."""
    header = (f"{'clip':<28} {'run':<16} {'frames':>6} {'warp err':>9} {'sharpness':>9} {'flicker':>8} "
              f"{'drift/1k':>9}")
    lines = [header, "-" * len(header)]
    for clip in report["clips"]:
        for label, result in clip["results"].items():
            slope = result["trend"]["warp_error"]["slope_per_1000_frames"]
            flicker = result["totals"]["flicker"]  # None: not measured (a file scored as it is)
            lines.append(f"{clip['clip'][:28]:<28} {label[:16]:<16} {result['frames']:>6} "
                         f"{result['totals']['warp_error']:>9.3f} {result['totals']['sharpness']:>9.2f} "
                         f"{'-' if flicker is None else f'{flicker:.3f}':>8} "
                         f"{'-' if slope is None else f'{slope:+.3f}':>9}")
    return "\n".join(lines)


