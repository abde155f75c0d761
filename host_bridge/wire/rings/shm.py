"""The frame ring in POSIX / Windows shared memory: one segment per ring, slots back to back.

The segment rules here also serve a link's doorbell segment (`host_bridge.wire.doorbell`).

Segment names are random (`loom_<owner pid>_` + 48 random bits) and POSIX segments are created
mode 0600, so another user cannot guess or open them. Python's resource tracker is kept out of it (it would
unlink the host's segments when the engine, which only attaches, exits; and it spawns a helper
with `sys.executable`, which inside TouchDesigner is not Python): the host removes its segments
on close, and an engine that finds its host dead removes them before it exits. Should both die
at once (a killed process group), the next ring (or doorbell) created on this machine sweeps the segments whose
owner pid is gone (Linux lists segments under /dev/shm; elsewhere there is nothing to list).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import sys
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from loom_live.host_bridge.wire.processes import pid_alive
from loom_live.host_bridge.wire.protocol import SEGMENT_NAME, RingSpec
from loom_live.host_bridge.wire.rings.base import Ring, packed_pitch

NAME_PREFIX = "loom_"
SHM_DIR = "/dev/shm"
_OWNED_NAME = re.compile(r"^loom_(\d+)_[0-9a-f]+$")


def sweep_stale_segments() -> list[str]:
    """Remove ring segments whose owning process no longer exists; returns their names."""
    if sys.platform == "win32" or not os.path.isdir(SHM_DIR):
        return []
    removed = []
    for name in os.listdir(SHM_DIR):
        m = _OWNED_NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            try:
                shared_memory._posixshmem.shm_unlink("/" + name)  # noqa: SLF001
                removed.append(name)
            except OSError:
                pass
    return removed


def new_segment_name() -> str:
    """A fresh segment name: this process's pid (for the sweep) and 48 random bits."""
    return f"{NAME_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"


def is_segment_name(name: str) -> bool:
    return SEGMENT_NAME.fullmatch(name) is not None


def open_segment(name: str, create: bool, size: int = 0) -> shared_memory.SharedMemory | PosixSegment:
    """Create (mode 0600) or open a segment, kept away from Python's resource tracker."""
    if sys.version_info >= (3, 13):
        shm = shared_memory.SharedMemory(name=name, create=create, size=size, track=False)
        if create:
            try:
                reserve_pages(shm._fd, size, name)  # noqa: SLF001 (the descriptor is kept open on POSIX)
            except BaseException:
                shm.close()
                shm.unlink()
                raise
        return shm
    if sys.platform != "win32":
        return PosixSegment(name, create, size)  # SharedMemory would start the tracker process to register it
    return shared_memory.SharedMemory(name=name, create=create, size=size)


def reserve_pages(fd: int, size: int, name: str) -> None:
    """Take the segment's memory now: on tmpfs `ftruncate` reserves nothing, and a write that later reaches a
    page /dev/shm has no room for kills the whole process with SIGBUS (a default container has 64 MB)."""
    if not hasattr(os, "posix_fallocate") or fd < 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise OSError(exc.errno, f"shm segment {name}: cannot reserve {size} bytes in shared memory "
                                 f"({exc.strerror}); give /dev/shm more room (a container's --shm-size) "
                                 "or use transport tcp") from None


class PosixSegment:
    """A POSIX shared-memory segment mapped directly (Python < 3.13): `SharedMemory` there registers every
    segment with multiprocessing's resource tracker, which starts a helper process (with `sys.executable`,
    not Python inside TouchDesigner) that unlinks the segments when the process that merely attached exits.
    The same attributes as `SharedMemory` that the rings and the doorbell use."""

    def __init__(self, name: str, create: bool, size: int = 0):
        if create and size <= 0:
            raise ValueError(f"shm segment {name}: size {size}; expected a positive size")
        self.name = name
        self._name = "/" + name  # the POSIX name, as `SharedMemory._name`
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = shared_memory._posixshmem.shm_open(self._name, flags, mode=0o600)  # noqa: SLF001
        try:
            if create:
                os.ftruncate(fd, size)
                reserve_pages(fd, size, name)
            self.size = os.fstat(fd).st_size
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.size)
        except BaseException:
            os.close(fd)
            if create:
                shared_memory._posixshmem.shm_unlink(self._name)  # noqa: SLF001
            raise
        os.close(fd)
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap; raises BufferError while a view of it is still alive, as `SharedMemory.close`."""
        if self.buf is not None:
            self.buf.release()
            self.buf = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


class ShmRing(Ring):
    copies_slots = True

    def __init__(self, spec: RingSpec, shm: shared_memory.SharedMemory, owner: bool):
        self.spec = spec
        self._shm: shared_memory.SharedMemory | None = shm
        self._owner = owner
        rows = np.ndarray((spec.slots, spec.height, spec.pitch), np.uint8, buffer=shm.buf)
        row_bytes = spec.row_bytes
        self._views = [rows[i, :, :row_bytes].view(spec.dtype).reshape(self.shape) for i in range(spec.slots)]

    @classmethod
    def create(cls, **fields: Any) -> ShmRing:
        pitch = packed_pitch(fields["width"], fields["channels"], fields["dtype"])
        spec_fields = {k: v for k, v in fields.items() if k not in ("handles", "pitch")}
        size = pitch * fields["height"] * fields["slots"]
        sweep_stale_segments()
        name = new_segment_name()
        shm = open_segment(name, create=True, size=size)
        spec = RingSpec(pitch=pitch, handles=[name], **spec_fields)
        return cls(spec, shm, owner=True)

    @classmethod
    def attach(cls, spec: RingSpec) -> ShmRing:
        if len(spec.handles) != 1 or not spec.handles[0].startswith(NAME_PREFIX):
            raise ValueError(f"shm ring: expected one segment name starting with {NAME_PREFIX!r}, got {spec.handles}")
        shm = open_segment(spec.handles[0], create=False)
        if shm.size < spec.slot_bytes * spec.slots:
            shm.close()
            raise ValueError(f"shm segment {spec.handles[0]} has {shm.size} bytes; the ring needs "
                             f"{spec.slot_bytes * spec.slots}")
        return cls(spec, shm, owner=False)

    @property
    def name(self) -> str:
        return self.spec.handles[0]

    def write(self, slot: int, frame: np.ndarray) -> list[Any]:
        self.check_slot(slot)
        self.check_frame(frame)
        np.copyto(self._views[slot], frame)
        return []

    def read(self, slot: int, payload: list[bytes]) -> np.ndarray:
        self.check_slot(slot)
        return self._views[slot].copy()

    def copy_to(self, slot: int, other: ShmRing, other_slot: int, *, wait: bool = True) -> None:
        """Slot to slot (the pass-through engine between two rings of the same layout), no frame array."""
        self.check_slot(slot)
        other.check_slot(other_slot)
        np.copyto(other._views[other_slot], self._views[slot])  # noqa: SLF001 (same class)

    def close(self) -> None:
        shm, self._shm = self._shm, None
        if shm is None:
            return
        self._views = []
        try:
            shm.close()
        except BufferError:  # a view escaped; the mapping goes when the process ends
            pass
        if self._owner:
            unlink_segment(shm)

    def remove(self) -> None:
        """Unlink the segment (used by an engine whose host died); close first."""
        shm = self._shm
        self.close()
        if shm is not None and not self._owner:
            unlink_segment(shm)


def unlink_segment(shm: shared_memory.SharedMemory | PosixSegment) -> None:
    """Remove a segment's name (bypassing the resource tracker); mappings stay valid until closed."""
    if sys.platform == "win32":
        return  # Windows frees the mapping when the last handle closes
    try:
        shared_memory._posixshmem.shm_unlink(shm._name)  # noqa: SLF001
    except FileNotFoundError:
        pass
