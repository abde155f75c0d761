"""Options and exit codes every `loom` subcommand shares, so the same thing is spelled and ends the same way.

Every subcommand that runs a model (play, serve, bench, eval) takes the same `-c/--config` and
`--set`, with the same default preset; every one ends with the same exit code for the same event.
"""

from __future__ import annotations

import argparse
import math
from importlib import metadata

DEFAULT_CONFIG = "default"
EXIT_OK = 0
EXIT_USAGE = 2  # bad input, output, option, config or missing weights: one line says what and what is allowed
EXIT_ENGINE_FAILED = 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports it
EXIT_BROKEN_PIPE = 141  # what it printed to was closed (`| head`), as a shell reports SIGPIPE


def version() -> str:
    """Loom's installed version (the `loom-live` distribution), or 'unknown' when run from a bare checkout."""
    try:
        return metadata.version("loom-live")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """`-c/--config` and `--set`, spelled and defaulted the same on every subcommand that runs a model."""
    parser.add_argument("-c", "--config", default=DEFAULT_CONFIG, metavar="PRESET_OR_YAML",
                        help=f"preset name (see `loom info --presets`) or YAML file (default: {DEFAULT_CONFIG}, "
                             "the embedded model that runs anywhere)")
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                        help="override a config key, e.g. --set stream.steps=[700]; repeatable")


def add_overwrite_option(parser: argparse.ArgumentParser, also: str = "") -> None:
    """ffmpeg's convention: an existing output file is refused unless `-y/--overwrite` is given; `also` adds
    what else the command's -y does."""
    parser.add_argument("-y", "--overwrite", action="store_true",
                        help="replace output files that exist (without it an existing file is refused, "
                             f"as ffmpeg does without -y){also}")


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (frames, chunks, windows)."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    return _int_at_least(text, 0, "an integer of 0 or more")


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number of at least 0 (a rate, a size in GiB; 0 is their "off")."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of 0 or more, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of 0 or more, got {text}")
    return value


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
    return value
