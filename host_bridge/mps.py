"""Whether a CUDA process started here would run under NVIDIA MPS.

Why it matters: on one GPU the host, its engine and a standby loading beside it each hold a CUDA
context, and the GPU time-slices between contexts, so a host's small copy of the newest frame waits
for its slice behind an engine's work. Under MPS (NVIDIA's Multi-Process Service) the processes'
work runs in one context, side by side. A CUDA process joins the control daemon whose pipe folder
its environment names (`CUDA_MPS_PIPE_DIRECTORY`, /tmp/nvidia-mps without it) when it initialises
CUDA, so the daemon must run before the host starts (TouchDesigner, ComfyUI, a script); the engines
a bridge launches inherit the host's environment and join the same daemon. What it costs: a fatal
GPU fault in any client (an illegal address, not a killed or crashed process) ends the GPU work of
every client of that daemon on that GPU, the host's included, so Loom never starts one itself.
README.md, "One GPU, several processes", says how to start it; docs/performance.md what it buys.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE = Path("/tmp/nvidia-mps")
CONTROL_PIPE = "control"  # the control daemon's pipe in its pipe folder: there while the daemon runs


def daemon_pipe(env: Mapping[str, str] | None = None) -> Path | None:
    """The pipe folder of the MPS control daemon a CUDA process started with `env` (this process's
    environment by default) would join; None where no daemon runs there."""
    env = os.environ if env is None else env
    folder = Path(env[PIPE_ENV]) if env.get(PIPE_ENV) else DEFAULT_PIPE
    return folder if (folder / CONTROL_PIPE).exists() else None
