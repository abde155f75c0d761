"""Checks that need no engine, run before one is started: a run that cannot work fails once, at once,
with exit code 2 and one line, instead of after an engine start-up (or several, through restarts).
"""

from __future__ import annotations

import sys
from typing import Any

from loom_live.host_bridge.reach import CONNECT_TIMEOUT_S, check_reachable
from loom_live.host_bridge.wire.errors import UserError


def check_weights(cfg: Any) -> None:
    """Every weight the config needs is given or pulled (`loom pull`) and is the weights its key names, or
    the run is refused now. The paths given are checked first: a mistyped one is said as such, not hidden
    behind a list of the weights still to pull."""
    from loom_live.engine.models.loading import check_weight_files
    from loom_live.engine.models.weights import missing_weights, pull_name

    try:
        check_weight_files(cfg)  # each file is what its key needs: format, keys, shapes
    except ValueError as exc:  # CheckpointError, PromptError: they name the file and what is wrong
        raise UserError(str(exc)) from None
    missing = missing_weights(cfg)
    if missing:
        raise UserError(f"preset {pull_name(cfg)!r} needs weights that are not here: {'; '.join(missing)}. "
                        f"Run `loom pull {pull_name(cfg)}`, or give the paths with --set KEY=PATH "
                        "(or use -c default, the embedded model)")


def check_endpoint(endpoint: str, secret_file: str | None = None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A running engine can be reached and will take this host (host_bridge/reach.py); the command line
    takes no CurveZMQ keys, so a remote engine is refused here."""
    try:
        check_reachable(endpoint, secret_file, names=("--endpoint", "--secret-file"), timeout_s=timeout_s)
    except UserError as exc:
        if "no engine answers there" in str(exc):
            raise UserError(f"{exc}, or leave out --endpoint") from None
        raise


def check_transport(transport: str) -> None:
    """cuda-ipc needs cuda-python (the `cuda` extra) and a CUDA device on the host side."""
    if transport != "cuda-ipc":
        return
    if sys.platform == "darwin":
        raise UserError("--transport cuda-ipc: not available on macOS; use shm")
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise UserError("--transport cuda-ipc needs cuda-python: pip install 'loom-live[cuda]' "
                        "(on a machine with an NVIDIA GPU); or use shm") from None
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count == 0:
        raise UserError("--transport cuda-ipc: no CUDA device here; use shm")


def check_engine_run(cfg: Any, *, passthrough: bool = False, endpoint: str | None = None,
                     secret_file: str | None = None, transport: str = "shm") -> None:
    """All of the above that apply to a run that starts (or reaches) an engine."""
    check_transport(transport)
    if secret_file and not endpoint:
        raise UserError("--secret-file is for --endpoint (an engine this command starts gets its own token)")
    if endpoint:
        check_endpoint(endpoint, secret_file)  # a running engine has its own config and weights
    elif not passthrough:
        check_weights(cfg)
