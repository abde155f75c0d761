"""Output frames on their way back from the GPU, handed out in order once they are finished.

Why: a push that waited for its own chunk's frames left the GPU idle between pushes, and it
stopped the next chunk's preprocessing and VAE encode (the encode stream) from running while
this chunk denoises and decodes (the session's other two streams). Here a push enqueues its chunk's work and returns
the frames of chunks that are already finished; at most `max_unfinished` chunks may still run
on the GPU when a push returns, so the CPU never runs far ahead of the GPU (a queue there
would only add latency). Host frames come back through pinned memory with a non-blocking
copy; frames for a device caller stay on the device. On a CPU everything is finished at once.

A caller with work of its own to do on time (the engine server paces its outputs to the host) sets
`waiting`: a wait for the GPU is then a loop of short looks that calls it in between, on the caller's
thread, instead of one blocking wait that would hold that work back by up to a chunk.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

WAIT_LOOK_S = 0.0005  # with `waiting` set: how often a wait looks at its chunk's event


@dataclass
class _Entry:
    frames: np.ndarray | torch.Tensor
    done: torch.cuda.Event | None  # None: finished when added


class OutputQueue:
    def __init__(self, device: torch.device, max_unfinished: int) -> None:
        if max_unfinished < 0:
            raise ValueError(f"max_unfinished: {max_unfinished} must be >= 0")
        self.cuda = device.type == "cuda"
        self.max_unfinished = max_unfinished
        self._entries: deque[_Entry] = deque()
        self.waiting: Callable[[], None] | None = None  # called between looks while a take waits

    def __len__(self) -> int:
        """Chunks of frames not yet handed out (finished or not)."""
        return len(self._entries)

    def add(self, frames: torch.Tensor, to_host: bool) -> None:
        """Queue uint8 frames [T, H, W, 3] made on the current stream; `to_host`: hand out numpy."""
        if not self.cuda:
            self._entries.append(_Entry(frames.numpy() if to_host else frames, None))
            return
        if to_host:
            pinned = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
            pinned.copy_(frames, non_blocking=True)
            out: np.ndarray | torch.Tensor = pinned.numpy()  # the array keeps the pinned block alive
        else:
            out = frames
        done = torch.cuda.Event()
        done.record()
        self._entries.append(_Entry(out, done))

    def take(self, wait_all: bool = False) -> list[np.ndarray | torch.Tensor]:
        """The finished chunks, oldest first. Waits first until at most `max_unfinished` chunks
        are still running (none with `wait_all`)."""
        keep = 0 if wait_all else self.max_unfinished
        unfinished = [e for e in self._entries if e.done is not None]
        for entry in unfinished[:max(0, len(unfinished) - keep)]:
            if self.waiting is None:
                entry.done.synchronize()
            else:
                while not entry.done.query():
                    self.waiting()
                    time.sleep(WAIT_LOOK_S)
            entry.done = None
        ready = []
        while self._entries and (self._entries[0].done is None or self._entries[0].done.query()):
            frames = self._entries.popleft().frames
            if self.cuda and isinstance(frames, torch.Tensor):  # made on another stream, used on the caller's
                frames.record_stream(torch.cuda.current_stream(frames.device))
            ready.append(frames)
        return ready

    def clear(self) -> None:
        """Forget what is queued (a new stream); the GPU work still finishes on its own."""
        self._entries.clear()
