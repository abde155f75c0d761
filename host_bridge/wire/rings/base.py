"""One interface for the three frame transports (shm, cuda-ipc, tcp) and the writer's slot bookkeeping.

A ring is N slots of one frame each, in one direction. The writer copies a frame into a free slot
and only then publishes the slot index in a `frame` notice; the reader copies the frame out and
sends `release`; only then may the writer reuse that slot. With latest-wins delivery the reader
releases superseded notices unread, so a slow reader never makes the writer queue anything: when
no slot is free the writer keeps just the newest frame aside (see `SlotTracker`).

The host creates (owns) every ring, the engine attaches; so the host alone removes shared
memory, and the engine removes it only when it finds its host gone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Any

import numpy as np

from loom_live.host_bridge.wire.protocol import DTYPE_SIZES, ProtocolError, RingSpec


class TransportUnavailable(RuntimeError):
    """The transport cannot work here (for example cuda-ipc without cuda-python or a GPU)."""


class Ring(ABC):
    """One direction's frame slots; `write`/`read` move numpy frames of the spec's shape and dtype."""

    spec: RingSpec
    # What a ring can do beyond numpy frames, declared so that users ask rather than probe:
    on_device = False  # slots in GPU memory, moved with `read_device`/`write_device` (raw device pointers)
    copies_slots = False  # `copy_to` moves a slot into another ring of the same kind and layout

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.spec.height, self.spec.width, self.spec.channels)

    def check_frame(self, frame: np.ndarray) -> None:
        if frame.shape != self.shape or frame.dtype != np.dtype(self.spec.dtype):
            raise ValueError(f"frame {frame.dtype} {frame.shape} does not fit ring slots "
                             f"{self.spec.dtype} {self.shape}")

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.spec.slots:
            raise ProtocolError(f"slot {slot} is outside the ring (0..{self.spec.slots - 1})")

    @abstractmethod
    def write(self, slot: int, frame: np.ndarray) -> list[Any]:
        """Copy `frame` into `slot`; return the payload parts to send with the notice (tcp) or []."""

    @abstractmethod
    def read(self, slot: int, payload: list[bytes]) -> np.ndarray:
        """Return a copy of the frame in `slot` (payload: the parts that came with the notice)."""

    @abstractmethod
    def close(self) -> None:
        """Detach; the owner also removes the shared memory. Safe to call twice."""

    def copy_to(self, slot: int, other: Ring, other_slot: int, *, wait: bool = True) -> None:
        """Copy `slot` into `other_slot` of `other` (same kind and layout) without a frame array; `wait`
        false: return once the copy is queued (`other.wait_writes()` then says when `slot` was read)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy slots; check `copies_slots` first")

    def write_done(self, slot: int) -> bool:
        """Whether the last write into `slot` is done (host memory: a write is done when it returns)."""
        return True

    def wait_writes(self) -> None:
        """Return when every copy into this ring queued without waiting is done (host memory: at once)."""
        return None  # host-memory copies are done when `copy_to` returns

    def remove(self) -> None:
        """Remove shared resources even when not the owner (the owner died); by default, just close."""
        self.close()


class SlotTracker:
    """Writer side: which slots are free, which are published and not yet released."""

    def __init__(self, slots: int):
        self.slots = slots
        self._free: deque[int] = deque(range(slots))
        self._published: set[int] = set()

    def acquire(self) -> int | None:
        return self._free.popleft() if self._free else None

    def unacquire(self, slot: int) -> None:
        """Give back a slot acquired but not published (the write failed)."""
        self._free.appendleft(slot)

    def publish(self, slot: int) -> None:
        self._published.add(slot)

    def release(self, slot: int) -> bool:
        """Mark a published slot free again; False (a refusal) for a slot that was not published."""
        if slot not in self._published:
            return False
        self._published.discard(slot)
        self._free.append(slot)
        return True

    @property
    def in_flight(self) -> int:
        return len(self._published)

    @property
    def free(self) -> int:
        return len(self._free)


def packed_pitch(width: int, channels: int, dtype: str, align: int = 1) -> int:
    row = width * channels * DTYPE_SIZES[dtype]
    return -(-row // align) * align
