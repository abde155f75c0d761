"""``loom eval FILE...``: score video files for temporal quality (warp error, sharpness, flicker, drift).

By default the files are scored as they are (a render from ``loom play``, or any video): output =
input, no engine. ``--restyle`` runs them through the engine first (``-c``/``--set`` as everywhere),
and ``--compare OTHER`` adds a second config on the same clips, drawn on the same plot. Short clips
can be stretched to long runs with ``--frames`` (played forwards and backwards, so the loop adds no
scene cut) to show drift.

This module opens the files and parses arguments; the measuring is ``engine.tools.eval``, which
takes frames as arrays.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from loom_live.engine.tools.eval import (
    DEFAULT_CHUNK,
    Clip,
    EvalError,
    EvalRun,
    EvalSettings,
    IdentityProcessor,
    evaluate,
    format_notes,
    format_table,
    output_names,
    ping_pong,
    previous_outputs,
)
from loom_live.engine.tools.quality import DEFAULT_WINDOW, FLOW_METHODS
from loom_live.host_bridge.wire.errors import OneLineParser, UserError
from loom_live.plugin.cli.common import add_config_options, add_overwrite_option, positive_int
from loom_live.plugin.media.base import MediaError
from loom_live.plugin.media.generated_clip import generate_clip
from loom_live.plugin.media.sources import open_source

VIDEO_SUFFIXES = (".mp4", ".mkv", ".mov", ".avi", ".webm", ".m4v", ".ts")
DEFAULT_OUT = "loom_eval"
GENERATED_CLIP_FRAMES = 120
GENERATED_CLIP_SIZE = (832, 480)
AS_IS = "as-is"


def find_clips(paths: list[str], frames: int | None, size: tuple[int, int] | None) -> list[Clip]:
    """Files and folders (their video files, sorted) given on the command line; none: the built-in clip."""
    if not paths:
        count = frames or GENERATED_CLIP_FRAMES
        width, height = size or GENERATED_CLIP_SIZE
        return [Clip("generated", "generated", lambda: iter(generate_clip(count, (width, height), seed=0)), count)]
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
        with open_source(path) as source:  # fail now, before any engine time is spent
            count = frames or source.frame_count
        clips.append(Clip(path.name, str(path), _file_frames(path, frames, size), count))
    return clips


def _file_frames(path: Path, frames: int | None, size: tuple[int, int] | None
                 ) -> Callable[[], Iterator[np.ndarray]]:
    def produce() -> Iterator[np.ndarray]:
        with open_source(path) as source:
            try:
                stream = ping_pong(iter(source), frames) if frames else iter(source)
                for frame in stream:
                    yield cv2.resize(frame, size, interpolation=cv2.INTER_AREA) if size else frame
            except ValueError as exc:
                raise MediaError(f"{path}: {exc}") from None
    return produce


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``eval`` on the ``loom`` command's subparsers."""
    parser = subparsers.add_parser(
        "eval", help="score video files for temporal quality (warp error, sharpness, flicker, drift)",
        description="Score clips as they are (default) or restyled by the engine (--restyle), and write a JSON "
                    "report and a PNG plot per clip (plots: pip install 'loom-live[eval]').")
    parser.add_argument("clips", nargs="*", metavar="CLIP",
                        help="video files or folders of clips (default: the built-in generated clip)")
    parser.add_argument("--restyle", action="store_true",
                        help="run the clips through the engine (-c/--set) and score its output, not the files")
    add_config_options(parser)
    parser.add_argument("--compare", metavar="OTHER", help="a second preset or YAML, run on the same clips "
                                                           "(implies --restyle)")
    parser.add_argument("--out", "-o", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT}/)")
    add_overwrite_option(parser, also="; with it the plots the earlier report.json in --out lists and this run "
                                      "does not write are removed once the new report is written, other files "
                                      "there are left as they are; a run that fails leaves the earlier report "
                                      "and its plots as they were")
    parser.add_argument("--frames", type=positive_int,
                        help="frames per clip: cut, or play back and forth to reach long runs")
    parser.add_argument("--size", type=_parse_size, metavar="WxH", help="resize input frames first")
    parser.add_argument("--window", type=positive_int, default=None,
                        help=f"frames per drift window (default: fitted to each clip, at most {DEFAULT_WINDOW})")
    parser.add_argument("--flow", choices=FLOW_METHODS, default="farneback",
                        help="optical flow on the input frames (none: no motion compensation)")
    parser.add_argument("--occlusion", action="store_true",
                        help="leave out pixels where forward and backward flow disagree")
    parser.add_argument("--chunk", type=positive_int, default=DEFAULT_CHUNK,
                        help=f"frames pushed to the engine at a time (default {DEFAULT_CHUNK})")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Entry point of ``loom eval``; returns the exit code (2 with a message for bad input)."""
    try:
        check_out_folder(Path(args.out))
        if args.window is not None and args.window < 2:
            raise ValueError(f"--window must be at least 2 frames, got {args.window}")
        runs = _runs_from_args(args)
        clips = find_clips(args.clips, args.frames, args.size)
        stale = claim_out_folder(Path(args.out), output_names(clips), args.overwrite)
        settings = EvalSettings(flow=args.flow, occlusion=args.occlusion, window=args.window,
                                chunk=args.chunk, progress=not args.quiet)
        report = evaluate(runs, clips, settings, Path(args.out), log=lambda m: print(m, file=sys.stderr))
        for path in stale:  # only once the new report is written: a failed run leaves the earlier one
            path.unlink(missing_ok=True)
    except (MediaError, ValueError, EvalError, OSError, UserError) as e:
        print(f"loom eval: error: {e}", file=sys.stderr)
        return 2
    print(format_table(report))
    print(format_notes())
    print(f"report: {Path(args.out) / 'report.json'}")
    return 0


def check_out_folder(out: Path) -> None:
    """--out is a folder (made when missing); one that is a file, or lies under one (`-o render.mp4`, as for
    `loom play`), is refused saying what --out is, instead of an OS error ("[Errno 17] File exists")."""
    there = next(p for p in (out, *out.parents) if p.exists())
    if not there.is_dir():
        raise UserError(f"--out {out}: {there} is a file; --out is the folder report.json and a PNG plot per clip "
                        f"go into (default {DEFAULT_OUT}/)")


def claim_out_folder(out: Path, names: list[str], overwrite: bool) -> list[Path]:
    """Before any work: a file the run would write that exists is refused without -y, naming it (a second run
    replaced report.json silently, beside the first run's plots). With -y, returns the earlier report's plots that
    this run does not write: removed once its report is written, so none is left to pass for part of it; files
    Loom did not list stay."""
    existing = [out / name for name in names if (out / name).exists()]
    if existing and not overwrite:
        more = f" (and {len(existing) - 1} more file(s) this run writes)" if len(existing) > 1 else ""
        raise UserError(f"--out {out}: {existing[0]} exists{more}; give --overwrite (-y) to replace it, or "
                        "another --out")
    return [p for p in previous_outputs(out) if p.name not in names] if overwrite else []


def _runs_from_args(args: argparse.Namespace) -> list[EvalRun]:
    if not (args.restyle or args.compare):
        return [EvalRun(AS_IS, IdentityProcessor, {"restyled": False})]
    from loom_live.plugin.cli.preflight import check_weights

    runs = []
    for config in (args.config, args.compare):
        if config:
            runs.append(_engine_run(config, args.overrides, check_weights))
    if len(runs) == 2 and runs[0].label == runs[1].label:
        runs[0].label, runs[1].label = f"{runs[0].label}_a", f"{runs[1].label}_b"
    return runs


def _engine_run(config_path: str, overrides: list[str], check: Callable[[Any], None]) -> EvalRun:
    """A run of the real engine; the config (a YAML file or a preset name) and its weights are checked
    now, the model loaded once per clip."""
    from loom_live.engine.config import load_config
    from loom_live.engine.session_api import open_session

    config = load_config(config_path, overrides)
    check(config)
    return EvalRun(Path(config_path).stem, lambda: open_session(config),
                   {"restyled": True, "config": config_path, "overrides": list(overrides)})


def _parse_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 832x480, got {text!r}") from None
    if width < 16 or height < 16:
        raise argparse.ArgumentTypeError(f"size must be at least 16x16, got {text}")
    return width, height


def main(argv: list[str] | None = None) -> int:
    """``python -m loom_live.plugin.cli.eval``: the same command without the ``loom`` front end."""
    parser = OneLineParser(prog="loom")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
