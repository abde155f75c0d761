"""The page's web server (aiohttp): the page itself, one WebSocket per open page for controls, state
and the WebRTC offer, and who drives.

It runs on its own thread and event loop, so the player's frame loop never waits for a browser.
Every request shows the token (access.py) and, for the WebSocket, comes from the page's own origin
(another site open in the same browser must not drive the show). A refused request gets one line
and a 403, and is logged at most once a minute per address: it touches nothing of the show. The
first page still open drives; the others watch, and their control messages are refused saying so.
A page's message that is not taken (not JSON, binary, a bad value) is refused to that page in words
and counted in the state's `refused` with the refused requests; its socket and the show go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from aiohttp import WSMsgType, web
from aiortc import RTCPeerConnection, RTCSessionDescription

from loom_live.host_bridge.wire.channel import is_loopback
from loom_live.plugin.player.controls import ControlError
from loom_live.plugin.web import frame_release
from loom_live.plugin.web.access import COOKIE, Access
from loom_live.plugin.web.ice import rtc_configuration
from loom_live.plugin.web.path_times import PathTimes
from loom_live.plugin.web.reference_upload import MAX_UPLOAD_BYTES
from loom_live.plugin.web.tracks import BoardTrack, FrameBoard, read_camera

log = logging.getLogger(__name__)
STATIC = Path(__file__).with_name("static")
STATE_INTERVAL_S = 0.25
MAX_PAGES = 8  # open pages at once: each costs a video encode on this machine
MAX_MESSAGE_BYTES = (MAX_UPLOAD_BYTES + 2) // 3 * 4 + 4096  # the largest: a reference upload, base64 in JSON
REFUSAL_LOG_S = 60.0
START_TIMEOUT_S = 10.0


class Show(Protocol):
    """What the server asks of the run it serves (plugin/web/host.py's WebHost)."""

    output_board: FrameBoard
    preview_board: FrameBoard | None  # the input, small (None: the driving page's own camera is the input)
    times: PathTimes  # the host's stages of the web path

    def hello(self) -> dict[str, Any]: ...

    def state(self) -> dict[str, Any]: ...

    def control(self, message: dict[str, Any]) -> str: ...

    def camera_frame(self, picture: Any) -> None: ...

    def page_report(self, report: dict[str, Any]) -> None: ...


class Page:
    """One open page: its socket, its WebRTC peer, the task reading its camera."""

    def __init__(self, number: int, ws: web.WebSocketResponse) -> None:
        self.number = number
        self.ws = ws
        self.pc: RTCPeerConnection | None = None
        self.reading: asyncio.Task[None] | None = None

    async def close_peer(self) -> None:
        if self.reading is not None:
            self.reading.cancel()
        if self.pc is not None:
            await self.pc.close()
        self.pc = self.reading = None


class PageServer:
    """Serves the page for `show` as `access` allows, on a thread of its own; `start()` returns once it listens."""

    def __init__(self, access: Access, make_show: Any, *, ice: list[dict[str, Any]] | None = None) -> None:
        self.access = access
        self.ice = list(ice or [])  # STUN/TURN servers (ice.py): the page's and this side's peers use them
        self._make_show = make_show
        self.show: Show | None = None
        self.loop = asyncio.new_event_loop()
        self._pages: list[Page] = []
        self._numbers = 0
        self._refusals: dict[str, float] = {}
        self.refused = 0  # requests and page messages refused
        self.port = access.port
        self._runner: web.AppRunner | None = None
        self._broadcaster: asyncio.Task | None = None  # ended at shutdown: a task left pending is an error at exit
        self._thread = threading.Thread(target=self.loop.run_forever, name="loom-web", daemon=True)

    # --- life --------------------------------------------------------------------------------

    def start(self) -> None:
        """Listen; RuntimeError (one line) when the address cannot be taken."""
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._listen(), self.loop)
        try:
            future.result(START_TIMEOUT_S)
        except OSError as exc:
            self.close()
            raise RuntimeError(f"--web: cannot listen on {self.access.host}:{self.access.port}: "
                               f"{exc.strerror or exc}") from None

    async def _listen(self) -> None:
        self.show = self._make_show(self.loop)
        app = web.Application(middlewares=[self._guard])
        app.router.add_get("/", self._index)
        app.router.add_get("/ws", self._socket)
        app.router.add_static("/static/", STATIC)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.access.host, self.access.port, ssl_context=self.access.tls)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        self._broadcaster = self.loop.create_task(self._broadcast())

    def close(self) -> None:
        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(5.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)

    async def _shutdown(self) -> None:
        if self._broadcaster is not None:
            self._broadcaster.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._broadcaster
        for page in list(self._pages):
            await page.close_peer()
            await page.ws.close()
        if self._runner is not None:
            await self._runner.cleanup()

    # --- who may in ----------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        presented = request.query.get("token") or request.cookies.get(COOKIE)
        if not self.access.allows(presented):
            return self._refuse(request, "a wrong or missing token; open the address printed at start "
                                         "(it ends with ?token=...)")
        if self.access.token is None and not _loopback_host(request.host):
            # no token guards a loopback page, so its name must be this machine's: a site whose name a DNS
            # rebinding points here would otherwise be same-origin with the page and drive the show
            return self._refuse(request, f"the page asked for by the name {request.host[:80]!r}; open it at "
                                         "127.0.0.1, [::1] or localhost")
        if request.path == "/ws" and not _same_origin(request):
            return self._refuse(request, "a WebSocket from another site's page")
        response = await handler(request)
        if self.access.token is not None and request.query.get("token"):
            response.set_cookie(COOKIE, self.access.token, httponly=True, samesite="Strict",
                                secure=self.access.tls is not None)
        return response

    def _refuse(self, request: web.Request, why: str) -> web.Response:
        self.refused += 1
        who = request.remote or "?"
        now = time.monotonic()
        if now - self._refusals.get(who, -REFUSAL_LOG_S) >= REFUSAL_LOG_S:
            self._refusals[who] = now
            log.warning("web: refused %s from %s: %s", request.path, who, why)
        return web.Response(status=403, text=f"loom web: refused: {why}\n")

    # --- the page -------------------------------------------------------------------------------

    async def _index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-store"})

    async def _socket(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(heartbeat=10.0, max_msg_size=MAX_MESSAGE_BYTES)
        if len(self._pages) >= MAX_PAGES:
            return self._refuse(request, f"{MAX_PAGES} pages are open already")
        await ws.prepare(request)
        self._numbers += 1
        page = Page(self._numbers, ws)
        self._pages.append(page)
        log.info("web: page %d opened from %s (%s)", page.number, request.remote, self._role(page))
        try:
            await ws.send_json({"type": "hello", **self.show.hello(), "ice_servers": self.ice,
                                "role": self._role(page)})
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await self._on_message(page, msg.data)
                elif msg.type == WSMsgType.BINARY:
                    await self._refuse_message(page, "a binary message; expected JSON text")
                elif msg.type == WSMsgType.ERROR:  # one over MAX_MESSAGE_BYTES: aiohttp has closed the socket
                    self.refused += 1
                    log.warning("web: page %d: %s", page.number, msg.data)
        finally:
            self._pages.remove(page)
            await page.close_peer()
            log.info("web: page %d closed", page.number)
        return ws

    def _role(self, page: Page) -> str:
        return "driver" if self._pages and self._pages[0] is page else "viewer"

    async def _on_message(self, page: Page, text: str) -> None:
        try:
            message = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: arrays or objects nested too deeply to read
            await self._refuse_message(page, "not JSON (or nested too deeply); expected a JSON object")
            return
        if not isinstance(message, dict):
            await self._refuse_message(page, "expected a JSON object")
            return
        kind = message.get("type")
        if kind == "offer":
            await self._answer(page, message)
        elif kind == "control":
            await self._control(page, message)
        elif kind == "report":
            if self._role(page) == "driver":
                self.show.page_report(message)
        else:
            await self._refuse_message(page, f"unknown message type {str(kind)[:40]!r}; known: offer, control, report")

    async def _refuse_message(self, page: Page, why: str) -> None:
        """Say to the page why its message was not taken, and count it (the state's `refused`)."""
        self.refused += 1
        await page.ws.send_json({"type": "refused", "message": why})

    async def _control(self, page: Page, message: dict[str, Any]) -> None:
        if self._role(page) != "driver":
            await self._refuse_message(page, "read-only: another page drives the show; you may watch")
            return
        try:
            if message.get("control") == "reference":  # decoding an image must not hold up the pages' video
                done = await asyncio.get_running_loop().run_in_executor(None, self.show.control, message)
            else:
                done = self.show.control(message)
        except (ControlError, ValueError, TypeError, OverflowError) as exc:  # any bad value: refused, page kept
            await self._refuse_message(page, str(exc))
            return
        await page.ws.send_json({"type": "accepted", "message": done})

    async def _answer(self, page: Page, message: dict[str, Any]) -> None:
        """The page's WebRTC offer: the restyled output (and the input preview) to it, its camera to the show."""
        await page.close_peer()
        sdp = message.get("sdp")
        if not isinstance(sdp, str) or not sdp.startswith("v=0"):
            await self._refuse_message(page, "WebRTC offer refused: its sdp is not a session description (one starts "
                                             "'v=0'); expected the offer of the page's RTCPeerConnection")
            return
        pc = page.pc = RTCPeerConnection(configuration=rtc_configuration(self.ice))

        @pc.on("track")
        def _on_track(track: Any) -> None:
            if track.kind == "video" and page.reading is None:
                page.reading = self.loop.create_task(read_camera(track, lambda a: self._camera(page, a)))

        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
            frame_release.install(pc)
            pc.addTrack(BoardTrack(self.show.output_board, self.show.times))
            if self.show.preview_board is not None:
                pc.addTrack(BoardTrack(self.show.preview_board))
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as exc:  # a malformed offer ends this page's video, not the show
            await page.close_peer()
            await self._refuse_message(page, f"WebRTC offer refused ({type(exc).__name__}: {exc}); expected the offer "
                                             "of the page's RTCPeerConnection")
            return
        await page.ws.send_json({"type": "answer", "sdp": pc.localDescription.sdp})

    def _camera(self, page: Page, picture: Any) -> None:
        if self._role(page) == "driver":
            self.show.camera_frame(picture)

    async def _broadcast(self) -> None:
        while True:
            await asyncio.sleep(STATE_INTERVAL_S)
            if not self._pages:
                continue
            try:
                state = {"type": "state", **self.show.state(), "pages": len(self._pages), "refused": self.refused}
            except Exception:  # the run is closing under us: skip this beat
                log.debug("web: state unavailable", exc_info=True)
                continue
            for page in list(self._pages):
                with contextlib.suppress(Exception):  # a page going away misses its beat
                    await page.ws.send_json({**state, "role": self._role(page)})


def _loopback_host(host: str) -> bool:
    """A Host header that names this machine literally (127.x, ::1, localhost), never resolved."""
    try:
        return is_loopback(f"tcp://{host}")
    except ValueError:  # EndpointError too: no name at all, or one no URL holds
        return False


def _same_origin(request: web.Request) -> bool:
    origin = request.headers.get("Origin")
    if origin is None:  # not a browser page (a script): the token, where asked, is the guard
        return True
    return urlsplit(origin).netloc.lower() == request.host.lower()
