"""Loom's engine: the models, the streaming sessions of each model family, and the server
(`python -m loom_live.engine serve`).

`loom_live.engine.StreamSession` is the in-process API (scripts, notebooks, tests); it is imported on first
use, so `loom` commands that do not need torch's models start quickly.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "StreamSession":
        from loom_live.engine.stream.session import StreamSession

        return StreamSession
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
