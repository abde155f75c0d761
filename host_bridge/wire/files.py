"""File helpers both sides need: writing a file, or a run's set of files, whole or not at all.

Torch-free and at the bottom of the layers, so the engine's writers (checkpoints, data files, reports) and
the `loom` commands that never load a model (`loom pull`) share the one helper rather than copies of it.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from loom_live.host_bridge.wire.processes import pid_alive

logger = logging.getLogger(__name__)

# .loom-<host of the run>-<its pid>-<random>.partial (a folder on a network share may hold another machine's runs)
_STAGING_NAME = re.compile(r"\.loom-(.+)-(\d{1,9})-\w+\.partial")


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


@contextmanager
def replacing_together(folder: Path, last: str) -> Iterator[Path]:
    """A fresh hidden folder inside `folder` (made when missing) for a run to write its files into. They replace
    their namesakes in `folder` only once the block ends without an error, the one named `last` after the others
    (a report that lists the rest: it never stands beside a mix of its own files and an earlier run's); a run
    that fails or is stopped midway removes the hidden folder and leaves `folder` as it was. Inside `folder`, not
    beside it: each move is then a rename on one filesystem, and a folder whose parent cannot be written
    (`--out .`) works. A run killed outright (SIGKILL, power loss) cannot remove its hidden folder, so the
    folder's name carries the run's machine and pid, and the next run in `folder` on that machine removes those of
    its runs no longer alive."""
    folder.mkdir(parents=True, exist_ok=True)
    _remove_dead_runs_staging(folder)
    staging = Path(tempfile.mkdtemp(prefix=f".loom-{_host()}-{os.getpid()}-", suffix=".partial", dir=folder))
    try:
        yield staging
        for path in sorted(staging.iterdir(), key=lambda p: p.name == last):
            os.replace(path, folder / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _host() -> str:
    """This machine's name as a folder name may hold it."""
    return re.sub(r"[^\w.-]", "_", socket.gethostname()) or "_"


def _remove_dead_runs_staging(folder: Path) -> None:
    """Remove the hidden folders in `folder` of this machine's runs that were killed outright. A name that does not
    parse is someone else's and is left alone, as is a live pid's (another run may be writing into it now) and
    another machine's (its pids mean nothing here)."""
    host = _host()
    for path in folder.iterdir():
        m = _STAGING_NAME.fullmatch(path.name)
        if m and m.group(1) == host and path.is_dir() and not pid_alive(int(m.group(2))):
            shutil.rmtree(path, ignore_errors=True)
            logger.info("removed %s, left by run %s that ended before finishing it", path, m.group(2))
