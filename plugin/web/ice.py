"""STUN and TURN servers for the page's WebRTC connection, given on the command line, for both ends.

Between a browser and a box on one LAN (or one machine) ICE host candidates are enough. A GPU box
behind NAT, or a browser on another network, needs a STUN server (each end learns its public
address) or, when UDP cannot pass at all, a TURN server that relays the video. The same list goes
to the host's peer (aiortc) and to the page (in its hello), since both ends gather candidates.

A TURN server needs a username and a credential. The credential is a secret: it is read from a
file only its owner may read (`--ice-credential-file`) or from the environment
(LOOM_ICE_CREDENTIAL), never from the command line, where other users can see it. It reaches the
page, which needs it to use the relay: the page is only served to those who show the token.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from loom_live.host_bridge.wire.errors import UserError

CREDENTIAL_ENV = "LOOM_ICE_CREDENTIAL"
SCHEMES = ("stun", "turn", "turns")
_URL = re.compile(r"(?P<scheme>[a-z]+):(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(?::(?P<port>\d{1,5}))?"
                  r"(?:\?transport=(?P<transport>udp|tcp))?")


def ice_servers(urls: list[str], *, username: str | None = None, credential_file: str | None = None,
                env: Mapping[str, str] = os.environ) -> list[dict[str, Any]]:
    """The servers as the page's RTCConfiguration.iceServers takes them; UserError (one line) for a bad one."""
    servers: list[dict[str, Any]] = []
    credential: str | None = None
    for url in urls:
        found = _URL.fullmatch(url.strip())
        if found is None or found["scheme"] not in SCHEMES:
            raise UserError(f"--ice-server {url!r}: expected stun:HOST[:PORT], turn:HOST[:PORT][?transport=udp|tcp] "
                            "or turns:HOST[:PORT] (e.g. stun:stun.example.org:3478)")
        if found["port"] is not None and not 0 < int(found["port"]) <= 65535:
            raise UserError(f"--ice-server {url!r}: port {found['port']} is not a port (1..65535)")
        if found["scheme"] == "stun" and found["transport"]:
            raise UserError(f"--ice-server {url!r}: a STUN server takes no ?transport=")
        server: dict[str, Any] = {"urls": url.strip()}
        if found["scheme"] != "stun":
            if credential is None:
                credential = _credential(credential_file, env)
            if not username or credential is None:
                raise UserError(f"--ice-server {url!r}: a TURN server needs --ice-username NAME and a credential, "
                                f"in --ice-credential-file FILE (mode 600) or the {CREDENTIAL_ENV} variable")
            server.update(username=username, credential=credential)
        servers.append(server)
    if (username or credential_file) and not any(s["urls"].startswith("turn") for s in servers):
        raise UserError("--ice-username/--ice-credential-file: they are for a TURN server; give one with "
                        "--ice-server turn:HOST[:PORT]")
    return servers


def _credential(path: str | None, env: Mapping[str, str]) -> str | None:
    if path:
        return _read_private(path)
    return env.get(CREDENTIAL_ENV) or None


def _read_private(path: str) -> str:
    """The first line of a file only its owner may read (a TURN password may be short, unlike a session secret)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"--ice-credential-file {path}: not a regular file")
        if os.name != "nt" and st.st_mode & 0o077:
            raise UserError(f"--ice-credential-file {path}: mode {stat.S_IMODE(st.st_mode):o} lets others read it; "
                            "expected 600 (chmod 600)")
        with open(path, encoding="utf-8") as f:
            line = f.readline(1024).strip()
    except OSError as exc:
        raise UserError(f"--ice-credential-file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"--ice-credential-file {path}: not UTF-8 text") from None
    if not line:
        raise UserError(f"--ice-credential-file {path}: empty; expected the credential on its first line")
    return line


def rtc_configuration(servers: list[dict[str, Any]]) -> Any:
    """The host peer's aiortc RTCConfiguration for `servers` (None: aiortc's default, host candidates)."""
    if not servers:
        return None
    from aiortc import RTCConfiguration, RTCIceServer

    return RTCConfiguration(iceServers=[RTCIceServer(urls=s["urls"], username=s.get("username"),
                                                     credential=s.get("credential")) for s in servers])
