"""Checks that need no engine, run before one is started: a run that cannot work fails once, at once,
with exit code 2 and one line, instead of after an engine start-up (or several, through restarts).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from host_bridge.wire.channel import EndpointError, is_loopback, read_secret_file
from host_bridge.wire.errors import UserError

CONNECT_TIMEOUT_S = 3.0


def check_weights(cfg: Any) -> None:
    """Every weight the config needs is given or pulled (`loom pull`), or the run is refused now."""
    from engine.models.weights import missing_weights

    missing = missing_weights(cfg)
    if missing:
        raise UserError(f"preset {cfg.model.preset!r} needs weights that are not here: {'; '.join(missing)}. "
                        f"Run `loom pull {cfg.model.preset}`, or give the paths with --set KEY=PATH "
                        "(or use -c default, the embedded model)")


def check_endpoint(endpoint: str, secret_file: str | None = None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A running engine can be reached and will take this host: an engine served on this machine takes
    only hosts that hold its session secret (`loom serve --secret-file`), a remote one only hosts with
    CurveZMQ keys, which the command line does not take; a tcp:// endpoint accepts a connection within
    a few seconds, an ipc:// one exists. Without these checks a host would wait for a handshake that
    never comes, through restarts."""
    try:
        local = is_loopback(endpoint)
    except EndpointError as exc:
        raise UserError(f"--endpoint: {exc}") from None
    if not local:
        raise UserError(f"--endpoint {endpoint}: not an address on this machine; a remote engine takes only hosts "
                        "with CurveZMQ keys, which a host script gives to the bridge (BridgeConfig "
                        "curve_secret_file, curve_server_public_file), not the command line")
    if not secret_file:
        raise UserError(f"--endpoint {endpoint}: an engine served on this machine takes only hosts that hold its "
                        "session secret; give --secret-file FILE, the file its `loom serve --secret-file` uses")
    try:
        read_secret_file(secret_file)
    except EndpointError as exc:
        raise UserError(f"--secret-file: {exc}") from None
    parts = urlsplit(endpoint)
    if parts.scheme == "ipc":
        if not Path(endpoint[len("ipc://"):]).exists():
            raise UserError(f"--endpoint {endpoint}: nothing listens there (no such socket file)")
        return
    if parts.scheme != "tcp" or not parts.hostname or not parts.port:
        raise UserError(f"--endpoint {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise UserError(f"--endpoint {endpoint}: no engine answers there ({why} after at most {timeout_s:g} s); "
                        "start one with `loom serve --bind ...`, or leave out --endpoint") from None


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
