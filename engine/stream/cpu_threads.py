"""How many threads torch computes with in an engine process on a CPU.

A launched engine shares the machine with its host: the player decodes the input, encodes the
output files and moves frames through the bridge beside it. torch's default, one thread per core,
leaves the host no core of its own; every parallel region of the model then waits for a thread
that the host (or any other work on the machine) has pre-empted, and on a loaded small CPU the
model runs several times slower than with fewer threads (docs/performance.md, "The player path on
a CPU"). So a CPU engine computes, by default, on one core less than it may use, and at least one.
`model.cpu_threads` (or OMP_NUM_THREADS) sets the number instead. The cores counted are those the
process may run on (its CPU affinity), which also sizes the edit family's flow workers.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS says it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def engine_threads(setting: int, cores: int) -> int:
    """`setting` when given (> 0), else one less than `cores`, at least one."""
    return setting if setting > 0 else max(1, cores - 1)


def apply_cpu_threads(setting: int, device: torch.device) -> int | None:
    """Set torch's thread count for a CPU session; returns it (None: a GPU session, or OMP_NUM_THREADS rules)."""
    if device.type != "cpu" or (setting == 0 and "OMP_NUM_THREADS" in os.environ):
        return None
    threads = engine_threads(setting, usable_cores())
    torch.set_num_threads(threads)
    log.info("computing on %d CPU thread(s)", threads)
    return threads
