"""File helpers both sides need: writing a file whole or not at all.

Torch-free and at the bottom of the layers, so the engine's writers (checkpoints, data files, reports) and
the `loom` commands that never load a model (`loom pull`) share the one helper rather than copies of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def write_replacing(out: Path, write: Callable[[BinaryIO], Any]) -> None:
    """`write(file)` into OUT.partial, which replaces `out` only once it is whole: a run that fails or is
    stopped while writing (a full disk, Ctrl-C) leaves the file an earlier run made as it was."""
    partial = out.with_name(out.name + ".partial")
    try:
        with open(partial, "wb") as f:
            write(f)
        os.replace(partial, out)
    except BaseException as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # a full disk says no name: name the file
            raise OSError(exc.errno, exc.strerror, str(out)) from None
        raise
