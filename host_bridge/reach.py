"""Whether a running engine will take this host, checked before a bridge waits for its handshake.

An engine served on this machine (`loom serve --bind`) lets in only hosts that hold its session
secret; a remote one only hosts with CurveZMQ keys; an absent peer never answers the hello. Without
these checks a host (the player, the TouchDesigner operator, the ComfyUI node) would wait for a
handshake that never comes, through restarts. A secret file that is readable but not the engine's
shows only in ZMQ's handshake: the bridge's control channel watches for that refusal and ends the
bridge with it. Every host runs the same check and names its own setting in the message (`names`:
what the host calls the endpoint and the secret file).
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit

from loom_live.host_bridge.wire.channel import EndpointError, is_loopback, read_secret_file
from loom_live.host_bridge.wire.errors import UserError

CONNECT_TIMEOUT_S = 3.0


def check_reachable(endpoint: str, secret_file: str | None, *, names: tuple[str, str] = ("endpoint", "secret file"),
                    timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise UserError saying what is wrong unless `endpoint` is an engine on this machine that listens
    and `secret_file` is a readable, private session secret (a tcp:// endpoint must accept a connection
    within `timeout_s`; an ipc:// one must exist)."""
    ep, sf = names
    try:
        local = is_loopback(endpoint)
        parts = urlsplit(endpoint)
        port = parts.port if parts.scheme == "tcp" else None
    except EndpointError as exc:
        raise UserError(f"{ep}: {exc}") from None
    except ValueError as exc:  # a mistyped port or address (tcp://host:99999, tcp://[::1): said like the rest
        raise UserError(f"{ep} {endpoint!r}: {exc}; expected tcp://HOST:PORT or ipc://PATH") from None
    if not local:
        raise UserError(f"{ep} {endpoint}: not an address on this machine; a remote engine takes only hosts "
                        "with CurveZMQ keys, which a host script gives to the bridge (BridgeConfig "
                        "curve_secret_file, curve_server_public_file)")
    if not secret_file:
        raise UserError(secret_needed(endpoint, names))
    try:
        read_secret_file(secret_file)
    except EndpointError as exc:
        raise UserError(f"{sf}: {exc}") from None
    if parts.scheme == "ipc":
        if not Path(endpoint[len("ipc://"):]).exists():
            raise UserError(f"{ep} {endpoint}: nothing listens there (no such socket file)")
        return
    if parts.scheme != "tcp" or not parts.hostname or not port:
        raise UserError(f"{ep} {endpoint!r}: expected tcp://HOST:PORT or ipc://PATH")
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise UserError(f"{ep} {endpoint}: no engine answers there ({why} after at most {timeout_s:g} s); "
                        "start one with `loom serve --bind ...`") from None


def secret_needed(endpoint: str, names: tuple[str, str] = ("endpoint", "secret_file")) -> str:
    """What a host without a secret file is told about an engine served on this machine (the bridge
    refuses such a configuration with it at construction, the hosts before they build a bridge)."""
    ep, sf = names
    return (f"{ep} {endpoint}: an engine served on this machine takes only hosts that hold its session secret; "
            f"give {sf} FILE, the file its `loom serve --secret-file` uses")
