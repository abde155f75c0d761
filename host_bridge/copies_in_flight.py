"""Device copies the bridge queued without waiting for them, and what each one must keep until it is done.

A host's frame loop (TouchDesigner's main thread) must not stop while the GPU, shared with the engine's
context, gets round to a copy: without MPS that turn can take several milliseconds. So the bridge queues
the copy of a host's frame into its staging buffer and keeps here what owns the source memory until the
GPU has passed it (TouchDesigner frees a `CUDAMemory` when the object is dropped). Each later call asks
the GPU, without waiting, which copies are done. At most `limit` stay in flight: past it the oldest is
waited for, so a GPU that falls behind slows the host instead of piling up memory.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from loom_live.host_bridge.wire.rings import cuda as device_ring  # its `cudart` read at each call (a test swaps it)
from loom_live.host_bridge.wire.rings.cuda import as_stream, check


class CopiesInFlight:
    """Points on CUDA streams, each with what to keep until the GPU has passed it; not thread-safe (the
    bridge calls it with its lock held)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit: {limit} is not allowed; expected at least 1")
        self.limit = limit
        self.waited = 0  # times the limit made a caller wait for the GPU
        self._flight: deque[tuple[int, Any, Any]] = deque()  # (device, event, kept), oldest first
        self._spare: list[tuple[int, Any]] = []  # finished events, reused
        self._done: list[Any] = []

    def __len__(self) -> int:
        return len(self._flight)

    def hold(self, stream: Any, device: int, kept: Any) -> None:
        """Keep `kept` until the GPU has done what is queued on `stream` (of `device`) now."""
        rt = device_ring.cudart
        check(rt.cudaSetDevice(device), "cudaSetDevice")
        event = self._event(device)
        check(rt.cudaEventRecord(event, as_stream(stream)), "cudaEventRecord")
        self._flight.append((device, event, kept))
        while len(self._flight) > self.limit:
            check(rt.cudaEventSynchronize(self._flight[0][1]), "cudaEventSynchronize")
            self.waited += 1
            self._finish_oldest()

    def done(self) -> list[Any]:
        """What was kept for copies the GPU has finished, oldest first, handed back once; never waits. Copies
        are judged in the order they were held (a finished one behind an unfinished one waits its turn)."""
        while self._flight and device_ring.event_done(self._flight[0][1]):
            self._finish_oldest()
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        """Wait for every copy still in flight, then forget what was kept (nothing is handed back)."""
        rt = device_ring.cudart
        for _, event, _ in self._flight:
            rt.cudaEventSynchronize(event)
        for device, event, _ in self._flight:
            self._spare.append((device, event))
        for _, event in self._spare:
            rt.cudaEventDestroy(event)
        self._flight.clear()
        self._spare.clear()
        self._done.clear()

    def _finish_oldest(self) -> None:
        device, event, kept = self._flight.popleft()
        self._spare.append((device, event))
        self._done.append(kept)

    def _event(self, device: int) -> Any:
        for i, (d, event) in enumerate(self._spare):
            if d == device:
                del self._spare[i]
                return event
        rt = device_ring.cudart
        return check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")

