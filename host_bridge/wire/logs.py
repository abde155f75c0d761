"""Logging setup shared by both entry points: the `loom` command (hosts) and `python -m loom_live.engine serve`.

Torch-free, so a host's interpreter (TouchDesigner's, say) can use it. Records of Loom's own
packages go to stderr, one line each: a launched engine's stderr is what the launcher keeps as
the tail the host's status shows, and its last line is what a host reports when the engine
exits. The level chosen on the host travels to the engines it launches (`engine_args`), so
`loom --log-level debug play` shows the engine's debug records too.
"""

from __future__ import annotations

import argparse
import logging
import sys

LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "info"
PACKAGES = ("loom_live",)
FORMAT = "%(levelname)s %(name)s: %(message)s"

_configured: str | None = None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time of the record (a test's capture, a host's
    redirection), not the stream of the moment it was configured."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def check_level(level: str) -> str:
    """The level's name in lower case; ValueError naming the allowed ones otherwise."""
    name = str(level).lower()
    if name not in LEVELS:
        raise ValueError(f"log level {level!r} is not allowed; allowed: {', '.join(LEVELS)}")
    return name


def add_option(parser: argparse.ArgumentParser, *, default: str | None = DEFAULT_LEVEL) -> None:
    """Add `--log-level`; `default=argparse.SUPPRESS` on a subcommand leaves a global option's value."""
    parser.add_argument("--log-level", type=str.lower, choices=LEVELS, default=default,
                        help=f"how much Loom logs to stderr (default: {DEFAULT_LEVEL})")


def configure(level: str = DEFAULT_LEVEL) -> None:
    """Send Loom's records at `level` and above to stderr. Calling it again changes the level;
    other libraries' records keep the root logger's level (warnings)."""
    global _configured
    name = check_level(level)
    root = logging.getLogger()
    if not any(isinstance(h, _StderrHandler) for h in root.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    for package in PACKAGES:
        logging.getLogger(package).setLevel(name.upper())
    _configured = name


def engine_args() -> list[str]:
    """The `--log-level` for an engine this process launches: the level configured here, if any."""
    return ["--log-level", _configured] if _configured else []
