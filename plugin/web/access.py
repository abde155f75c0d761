"""Who may open the page: the listening address, the token, and TLS, checked before anything starts.

A page that drives the show must not be reachable by a stranger. On a loopback address only this
machine's users reach it (and an SSH tunnel lands there too), so no token is needed unless a
token file is given. Any other address needs a token, printed at start or read from a private
file, and a channel that keeps it secret on the way: HTTPS from a certificate and key given here,
or the user's own TLS proxy in front (`--web-proxy`), which the user vouches for. The token
travels once in the page's address (`?token=...`); the server answers with a cookie that the
page's later requests carry, so the token does not have to appear in them.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

from loom_live.host_bridge.wire.channel import EndpointError, is_loopback, read_secret_file
from loom_live.host_bridge.wire.errors import UserError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
COOKIE = "loom_token"
TOKEN_BYTES = 18


@dataclass(frozen=True)
class Access:
    """Where the page listens and what a request must show."""

    host: str
    port: int
    token: str | None  # None: no token asked (loopback without a token file)
    tls: ssl.SSLContext | None

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def url(self, port: int | None = None) -> str:
        """The address to open, with the token when one is asked."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        shown = "127.0.0.1" if self.host in ("0.0.0.0", "::") else host
        query = f"/?token={self.token}" if self.token else "/"
        return f"{self.scheme}://{shown}:{self.port if port is None else port}{query}"

    def allows(self, presented: str | None) -> bool:
        """Whether a request showing `presented` (its token, from the query or the cookie) may in."""
        if self.token is None:
            return True
        return presented is not None and hmac.compare_digest(presented.encode(), self.token.encode())


def parse_listen(text: str, option: str = "--web") -> tuple[str, int]:
    """`PORT`, `HOST:PORT` or `[IPv6]:PORT` -> (host, port); UserError says what is allowed, naming the
    address as the user gave it (`option`: `--web` of `loom play`, or `loom web`'s positional address)."""
    spec = text.strip()
    if spec.isdigit():
        host, port_text = DEFAULT_HOST, spec
    else:
        parts = urlsplit(f"//{spec}")
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            host, port = None, None
        if not host or port is None:
            raise UserError(f"{option} {text!r}: expected PORT or HOST:PORT (e.g. 8080, 0.0.0.0:8443, [::1]:8080)")
        port_text = str(port)
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise UserError(f"{option} {text!r}: port {port} is not a TCP port (0..65535)")
    return host, port


def loopback(host: str) -> bool:
    if ":" in host:
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False
    try:
        return is_loopback(f"tcp://{host}:0")
    except EndpointError:
        return False


def make_access(listen: str, *, token_file: str | None = None, cert: str | None = None, key: str | None = None,
                proxy: bool = False, option: str = "--web") -> Access:
    """Check the page's settings and build its Access; UserError (one line) when they are unsafe or wrong."""
    host, port = parse_listen(listen, option)
    if (cert is None) != (key is None):
        raise UserError("--web-cert and --web-key: give both (the certificate and its private key) or neither")
    tls = _tls_context(cert, key) if cert and key else None
    remote = not loopback(host)
    if remote and tls is None and not proxy:
        raise UserError(f"{option} {listen}: {host} is not a loopback address, so the page and its token would cross "
                        "the network in the clear; give --web-cert FILE --web-key FILE (HTTPS), or --web-proxy "
                        "when your own HTTPS proxy fronts it, or listen on 127.0.0.1 and use an SSH tunnel")
    token = None
    if token_file:
        try:
            token = read_secret_file(token_file, create=True)
        except EndpointError as exc:
            raise UserError(f"--web-token-file: {exc}") from None
    elif remote:
        token = secrets.token_urlsafe(TOKEN_BYTES)
    return Access(host, port, token, tls)


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UserError(f"--web-cert/--web-key: cannot load {cert} with {key}: {exc}") from None
    return ctx
