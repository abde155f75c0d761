"""Where a file output is written until it is finished, and how it is moved into place.

A file is written to a hidden partial beside its target, locked for this run, and moved onto the target only
once finished: a run that fails, or two runs writing one output, never leave a half-written or mixed file where
the user looks, and a file made at the target during the run is never replaced unasked (``FrameSink``).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from loom_live.plugin.media.base import MediaError, reason


def partial_path(path: Path) -> Path:
    """Where a file output is written until it is finalised: beside the target (same drive, so the
    final rename is atomic), hidden, with the target's suffix (FFmpeg picks the container from it)."""
    return path.with_name(f".{path.stem}.loom-partial{path.suffix}")


def aside_path(path: Path, n: int) -> Path:
    """The ``n``-th name beside ``path`` for a finished file that must not replace one made there during the run."""
    return path.with_name(f"{path.stem}.loom-{n}{path.suffix}")


def move_without_replacing(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst`` in one step that raises FileExistsError where ``dst`` exists: a hard link then the
    unlink of ``src``; where the file system has no hard links (FAT, some network drives), ``dst`` claimed empty
    with O_EXCL, then replaced by ``src``. Either way a file made at ``dst`` meanwhile is never replaced."""
    try:
        os.link(src, dst)
        linked = True
    except FileExistsError:
        raise
    except OSError:
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        linked = False
    try:
        if linked:
            src.unlink()
        else:
            os.replace(src, dst)
    except OSError:
        with contextlib.suppress(OSError):
            dst.unlink()  # our own link or claim: the partial stays, and the caller says so
        raise


def claim_partial(partial: Path, name: str) -> int | None:
    """Lock a file output's partial for this run before FFmpeg truncates it; returns the descriptor that holds
    the lock until the output is finished or discarded.

    Two runs writing one output opened the same partial: both wrote into one file, which the first to finish
    moved onto the target (mixed, undecodable) while the other's recording was lost. A partial a run left when
    it was killed holds no lock and is taken over. Nothing is locked where flock is missing (Windows), fails
    (a file system without locks), or where the partial is not a regular file."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(partial, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK, 0o666)  # non-blocking: a FIFO opens at once
    except OSError as e:
        raise MediaError(f"{name}: cannot open for writing: {reason(e)}") from e
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except BlockingIOError:
        os.close(fd)
        raise MediaError(f"{name}: another run is writing this file now (its partial {partial.name} is in use); "
                         "let it finish, or give another -o") from None
    except OSError:
        pass
    os.close(fd)
    return None
