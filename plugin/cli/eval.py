"""``loom eval``: run clips through the engine and measure temporal quality (warp error, flicker, drift).

Why a command: every change to sinks, RoPE policy, noise control or scheduling should be
judged on the same numbers, on the same clips, in one line. ``--compare`` runs a second config
on the same clips and draws both on one plot; ``--identity`` (output = input) gives the floor a
perfectly stable pipeline would reach. Short clips can be stretched to long runs with
``--frames`` (played forwards and backwards, so the loop adds no scene cut) to show drift.

The engine is reached through one small function, ``run_clip``; everything else here works on
any object with ``push(frames) -> frames`` and ``flush() -> frames``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import cv2
import numpy as np

from engine.tools.quality import DEFAULT_WINDOW, FLOW_METHODS, QualityMeter, QualityReport, plot_reports
from plugin.media.video_io import MediaError, generate_clip, open_source

VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov", ".avi", ".webm", ".m4v", ".ts")
DEFAULT_CHUNK = 4
DEFAULT_OUT = "loom_eval"
GENERATED_CLIP_FRAMES = 120
GENERATED_CLIP_SIZE = (832, 480)
EVAL_REPORT_VERSION = 1
SUMMARY_METRICS = ("warp_error", "sharpness", "flicker", "output_diff", "luma_shift", "saturation_shift")


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
    """A clip to measure: where it comes from, and how to get its frames again for every run."""

    name: str
    source: str
    frames: Callable[[], Iterator[np.ndarray]]


@dataclass
class EvalSettings:
    flow: str = "farneback"
    occlusion: bool = False
    window: int = DEFAULT_WINDOW
    chunk: int = DEFAULT_CHUNK


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
                 meta: dict[str, Any] | None = None) -> QualityReport:
    """Stream a clip through ``processor`` and measure it; memory is bounded by the engine's lag.

    Output i is paired with input i. When the engine outputs another size than it was given
    (its own resolution), the input is resized to the output's size for the flow and the
    report's meta says so.
    """
    meter = QualityMeter(flow=settings.flow, occlusion=settings.occlusion, window=settings.window)
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
    """Measure every run on every clip; write ``report.json`` and one PNG per clip into ``out_dir``."""
    if not runs or not clips:
        raise ValueError("eval needs at least one run and one clip")
    out_dir.mkdir(parents=True, exist_ok=True)
    clip_entries = []
    plot_names: set[str] = set()
    for clip in clips:
        results: dict[str, QualityReport] = {}
        for run in runs:
            log(f"[eval] {clip.name}: {run.label} ...")
            results[run.label] = measure_clip(run.make_processor(), clip.frames(), settings,
                                              meta={"clip": clip.name, "run": run.label})
        plot_name = _unique(f"{Path(clip.name).stem}.png", plot_names)
        title = f"{clip.name}: " + " vs ".join(results)
        plot_reports(list(results.items()), out_dir / plot_name, title=title)
        clip_entries.append({"clip": clip.name, "source": clip.source, "plot": plot_name,
                             "results": {label: report.to_dict() for label, report in results.items()}})
    report = {
        "version": EVAL_REPORT_VERSION,
        "tool": "loom eval",
        "settings": {"flow": settings.flow, "occlusion": settings.occlusion, "window": settings.window,
                     "chunk": settings.chunk},
        "runs": [{"label": run.label, **run.info} for run in runs],
        "clips": clip_entries,
        "summary": _summary(runs, clip_entries),
    }
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


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


# ----------------------------------------------------------------------------------------------
# Clips


def find_clips(paths: list[str], frames: int | None, size: tuple[int, int] | None) -> list[Clip]:
    """Files and folders (their video files, sorted) given on the command line; none: the built-in clip."""
    if not paths:
        count = frames or GENERATED_CLIP_FRAMES
        width, height = size or GENERATED_CLIP_SIZE
        return [Clip("generated", "generated", lambda: iter(generate_clip(count, (width, height), seed=0)))]
    files: list[Path] = []
    for spec in paths:
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in VIDEO_SUFFIXES and p.is_file())
            if not found:
                raise MediaError(f"folder {path} holds no video clips ({', '.join(VIDEO_SUFFIXES)})")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise MediaError(f"clip not found: {path}")
    clips = []
    for path in files:
        with open_source(path):  # fail now, before any engine time is spent
            pass
        clips.append(Clip(path.name, str(path), _file_frames(path, frames, size)))
    return clips


def _file_frames(path: Path, frames: int | None, size: tuple[int, int] | None
                 ) -> Callable[[], Iterator[np.ndarray]]:
    def produce() -> Iterator[np.ndarray]:
        with open_source(path) as source:
            stream = _ping_pong(iter(source), frames) if frames else iter(source)
            for frame in stream:
                yield cv2.resize(frame, size, interpolation=cv2.INTER_AREA) if size else frame
    return produce


def _ping_pong(frames: Iterator[np.ndarray], count: int) -> Iterator[np.ndarray]:
    """``count`` frames: the clip, then back and forth over it (kept in memory once) as needed."""
    clip: list[np.ndarray] = []
    for frame in frames:
        if len(clip) == count:
            return
        clip.append(frame)
        yield frame
    if len(clip) < 2:
        raise MediaError(f"a clip needs at least 2 frames to loop, got {len(clip)}")
    cycle = clip[-2:0:-1] + clip  # backwards (ends excluded), then forwards again
    emitted = len(clip)
    while True:
        for frame in cycle:
            if emitted == count:
                return
            emitted += 1
            yield frame


# ----------------------------------------------------------------------------------------------
# Command line


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``eval`` on the ``loom`` command's subparsers."""
    parser = subparsers.add_parser(
        "eval", help="measure temporal quality (warp error, flicker, drift) of the engine on clips",
        description="Run clips through the engine and write a JSON report and a PNG plot of warp error, "
                    "flicker and colour drift per window of frames.")
    parser.add_argument("clips", nargs="*", metavar="CLIP",
                        help="video files or folders of clips (default: the built-in generated clip)")
    parser.add_argument("--config", "-c", help="engine config YAML (default: the built-in default)")
    parser.add_argument("--compare", metavar="OTHER_YAML", help="a second config, run on the same clips")
    parser.add_argument("--identity", action="store_true",
                        help="no engine: output = input (the baseline; replaces --config)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable; applies to both configs)")
    parser.add_argument("--out", "-o", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT}/)")
    parser.add_argument("--frames", type=_positive_int,
                        help="frames per clip: cut, or play back and forth to reach long runs")
    parser.add_argument("--size", type=_parse_size, metavar="WxH", help="resize input frames first")
    parser.add_argument("--window", type=_positive_int, default=DEFAULT_WINDOW,
                        help=f"frames per drift window (default {DEFAULT_WINDOW})")
    parser.add_argument("--flow", choices=FLOW_METHODS, default="farneback",
                        help="optical flow on the input frames (none: no motion compensation)")
    parser.add_argument("--occlusion", action="store_true",
                        help="leave out pixels where forward and backward flow disagree")
    parser.add_argument("--chunk", type=_positive_int, default=DEFAULT_CHUNK,
                        help=f"frames pushed to the engine at a time (default {DEFAULT_CHUNK})")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Entry point of ``loom eval``; returns the exit code (2 with a message for bad input)."""
    try:
        if args.window < 2:
            raise ValueError(f"--window must be at least 2 frames, got {args.window}")
        runs = _runs_from_args(args)
        clips = find_clips(args.clips, args.frames, args.size)
        settings = EvalSettings(flow=args.flow, occlusion=args.occlusion, window=args.window,
                                chunk=args.chunk)
        report = evaluate(runs, clips, settings, Path(args.out), log=lambda m: print(m, file=sys.stderr))
    except (MediaError, ValueError, EvalError, OSError) as e:
        print(f"loom eval: error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    print(f"report: {Path(args.out) / 'report.json'}")
    return 0


def _runs_from_args(args: argparse.Namespace) -> list[EvalRun]:
    runs = []
    if args.identity:
        runs.append(EvalRun("identity", IdentityProcessor, {"identity": True}))
    else:
        runs.append(_engine_run(args.config, args.overrides))
    if args.compare:
        runs.append(_engine_run(args.compare, args.overrides))
    if len(runs) == 2 and runs[0].label == runs[1].label:
        runs[0].label, runs[1].label = f"{runs[0].label}_a", f"{runs[1].label}_b"
    return runs


def _engine_run(config_path: str | None, overrides: list[str]) -> EvalRun:
    """A run of the real engine; the config (a YAML file or a preset name) is loaded and validated
    now, the model once per clip."""
    from engine.config import load_config
    from engine.session_api import open_session

    config = load_config(config_path, overrides)
    label = Path(config_path).stem if config_path else "default"
    return EvalRun(label, lambda: open_session(config),
                   {"identity": False, "config": config_path, "overrides": list(overrides)})


def format_table(report: dict[str, Any]) -> str:
    """The console summary: one line per clip and run."""
    header = (f"{'clip':<28} {'run':<16} {'frames':>6} {'warp err':>9} {'sharpness':>9} {'flicker':>8} "
              f"{'drift/1k':>9}")
    lines = [header, "-" * len(header)]
    for clip in report["clips"]:
        for label, result in clip["results"].items():
            slope = result["trend"]["warp_error"]["slope_per_1000_frames"]
            lines.append(f"{clip['clip'][:28]:<28} {label[:16]:<16} {result['frames']:>6} "
                         f"{result['totals']['warp_error']:>9.3f} {result['totals']['sharpness']:>9.3f} "
                         f"{result['totals']['flicker']:>8.3f} "
                         f"{'-' if slope is None else f'{slope:+.3f}':>9}")
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 832x480, got {text!r}") from None
    if width < 16 or height < 16:
        raise argparse.ArgumentTypeError(f"size must be at least 16x16, got {text}")
    return width, height


def main(argv: list[str] | None = None) -> int:
    """``python -m plugin.cli.eval``: the same command without the ``loom`` front end."""
    parser = argparse.ArgumentParser(prog="loom")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
