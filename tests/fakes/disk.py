"""A disk that fills up in the middle of a write, for the tests that a file is written whole or not at all."""

from __future__ import annotations

import errno
import io
from pathlib import Path

import pytest

from loom_live.host_bridge.wire import files


class FullDisk(io.FileIO):
    """A file that takes half of the first write's bytes, then fails as a full disk does (no file name)."""

    def write(self, data) -> int:
        whole = bytes(data)
        super().write(whole[: len(whole) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")


def fill_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file `write_replacing` writes from now on meets a full disk halfway."""
    monkeypatch.setattr(files, "open", FullDisk, raising=False)


def deny_entering(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Every path inside `folder` is refused as a folder of mode 000 refuses it (the tests may run as root, whom a
    real mode 000 does not stop): `stat`, and so `exists` and `is_file`, raise PermissionError."""
    stat = Path.stat

    def denied(self: Path, *args, **kwargs):
        if self.parent == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", denied)
