"""The web host as the player sees it: the page beside a run, and the browser's camera as its input.

`loom play --web` starts a `WebHost` beside whatever the run reads and writes; `loom web` also takes
its input from the driving page's camera (`camera`). The player calls three hooks on its own
thread, none of which waits: `input_frame` (each frame read), `submitted` (the bridge's sequence
number for it), `output` (each frame written). With them the host posts the restyled picture
(stamped with the camera frame it came from, stamp.py) and a small input preview for the pages,
and answers the pages' state and controls (server.py) from the bridge and the player's controls.

The player's live loop picks the engine's output up only when it reads the next input frame, up
to a camera frame period after the output came back; the pages should not wait for that. So a
thread of the host's own follows the bridge and posts each restyled frame the moment it arrives;
the player's `output` still posts what only it has (the fallback picture before the engine runs),
and a frame older than one already posted is never sent.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from loom_live.plugin.player.controls import Controls
from loom_live.plugin.web import stamp
from loom_live.plugin.web.access import Access
from loom_live.plugin.web.camera import BrowserCamera
from loom_live.plugin.web.page_controls import command_for, control_state, schema
from loom_live.plugin.web.path_times import PathTimes
from loom_live.plugin.web.server import PageServer
from loom_live.plugin.web.tracks import FrameBoard

log = logging.getLogger(__name__)
FOLLOW_WAIT_S = 0.25  # the follower's longest wait for an output before it looks at its stop flag
PREVIEW_SIDE = 160  # the input preview's longer side in pixels
PREVIEW_INTERVAL_S = 1 / 15
THROUGH_MEMORY = 64  # stamped frames whose time through the host and engine the pages are told
SEQ_MEMORY = 512  # sequence numbers whose stamps are kept until their output comes back


class WebHost:
    """The page server plus what it serves; `camera` is set when the page's camera is the input."""

    def __init__(self, access: Access, controls: Controls, size: tuple[int, int], fps: float, *,
                 camera: bool = False, ice: list[dict[str, Any]] | None = None) -> None:
        self.access = access
        self.controls = controls
        self.size = size
        self.camera = BrowserCamera(size, fps) if camera else None
        self.bridge: Any = None
        self.output_board: FrameBoard
        self.preview_board: FrameBoard | None = None
        self.report: dict[str, Any] = {}
        self.times = PathTimes()
        self._through: deque[tuple[int, float]] = deque(maxlen=THROUGH_MEMORY)  # (stamp, submitted to posted, ms)
        self._lock = threading.Lock()  # the player's thread and the follower both post outputs
        self._stamps: OrderedDict[int, tuple[int, float]] = OrderedDict()  # seq -> (stamp, submitted at)
        self._pending: tuple[int, float | None] = (0, None)  # the stamp of the frame read, when it came
        self._last_seq = -1
        self._last_preview = 0.0
        self._stop = threading.Event()
        self._follower: threading.Thread | None = None
        self.server = PageServer(access, self._boards, ice=ice)

    def _boards(self, loop: asyncio.AbstractEventLoop) -> WebHost:
        self.output_board = FrameBoard(loop)
        self.preview_board = None if self.camera is not None else FrameBoard(loop)
        return self

    def start(self) -> str:
        """Listen; returns the address to open. RuntimeError when the address is taken."""
        self.server.start()
        return self.access.url(self.server.port)

    def attach(self, bridge: Any) -> None:
        """The run's bridge, once it exists: the pages' state reads it, the follower posts its outputs."""
        self.bridge = bridge
        self._follower = threading.Thread(target=self._follow, args=(bridge,), name="loom-web-follow", daemon=True)
        self._follower.start()

    def close(self) -> None:
        self._stop.set()
        if self.camera is not None:
            self.camera.close()
        if self._follower is not None:
            self._follower.join(2 * FOLLOW_WAIT_S + 1.0)
        self.server.close()

    def _follow(self, bridge: Any) -> None:
        """Post each restyled frame as soon as the bridge has it (see the module's docstring)."""
        while not self._stop.is_set():
            want = self._last_seq + 1
            try:
                if not bridge.wait_for_output(want, FOLLOW_WAIT_S):
                    continue
                out, status = bridge.latest()
            except Exception:  # the bridge is closing under us: the run is ending
                log.debug("web: the follower stops", exc_info=True)
                return
            if out is None or status.fallback or status.seq < want:
                self._stop.wait(0.01)  # an output the bridge does not call fresh: the player shows what it has
                continue
            self._post(out, status.seq)

    # --- the player's hooks (its thread) ---------------------------------------------------------

    def input_frame(self, frame: np.ndarray) -> None:
        """A frame the player read, about to be submitted."""
        self._pending = self.camera.origin_of(frame) if self.camera is not None else (0, None)
        now = time.monotonic()
        if self.preview_board is not None and now - self._last_preview >= PREVIEW_INTERVAL_S:
            self._last_preview = now
            self.preview_board.post(_small(frame))

    def submitted(self, seq: int) -> None:
        """The bridge numbered the frame last given to `input_frame` `seq`."""
        code, arrived = self._pending
        now = time.monotonic()
        if arrived is not None:
            self.times.add("camera_to_submit", now - arrived)
        with self._lock:
            self._stamps[seq] = (code, now)
            while len(self._stamps) > SEQ_MEMORY:
                self._stamps.popitem(last=False)

    def output(self, frame: np.ndarray, seq: int) -> None:
        """A frame the player wrote; `seq` the input it was restyled from (-1: a fallback, not restyled)."""
        self._post(frame, seq)

    def _post(self, frame: np.ndarray, seq: int) -> None:
        """Send a frame to the pages, stamped with its camera frame's code; once per restyled frame, newest only."""
        with self._lock:
            if seq >= 0 and seq <= self._last_seq:
                return  # sent already (the follower was first, or the loop shows it again), or older than sent
            code, submitted = 0, None
            if seq >= 0:
                self._last_seq = seq
                while self._stamps and next(iter(self._stamps)) <= seq:  # older ones will never be sent
                    done, (code, submitted) = self._stamps.popitem(last=False)
                    if done != seq:
                        code, submitted = 0, None
        if submitted is not None:
            through = time.monotonic() - submitted
            self.times.add("submit_to_post", through)
            if code:
                self._through.append((code, round(1000 * through, 1)))
        picture = _fit(frame, self.size)
        self.output_board.post(np.concatenate([picture, stamp.encode(code, picture.shape[1])], axis=0))

    # --- what the server asks (its thread) --------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        w, h = self.size
        return {"mode": "camera" if self.camera is not None else "play", "size": [w, h],
                "fps": self.camera.fps if self.camera is not None else None,
                "stamp": {"rows": stamp.STAMP_ROWS, "bits": stamp.BITS, "code_bits": stamp.CODE_BITS},
                "schema": schema()}

    def state(self) -> dict[str, Any]:
        engine: dict[str, Any] = {"state": "starting"}
        session: dict[str, Any] = {}
        if self.bridge is not None:
            status = self.bridge.status()
            stats = self.bridge.stats()
            engine = {"state": str(status.state.value), "fps": round(status.fps, 2),
                      "latency_ms": round(status.latency_ms, 1), "dropped": status.dropped,
                      "message": status.message, "restarts": status.restarts, "frames_out": status.frames_out,
                      "standby": status.standby,  # "" without --standby; else where the standby is (ready...)
                      # what the engine refused while running (a prompt its embeddings file lacks): said on the page
                      "errors": stats.get("errors", 0), "last_error": stats.get("last_error", "")}
            report = stats.get("engine", {}).get("session") or {}
            session = {k: report.get(k) for k in ("prompt", "prompt_style", "prompt_blend", "steps", "noise_scale",
                                                  "lora_scales", "prompt_error", "params")}
        received = self.camera.received if self.camera is not None else None
        return {"engine": engine, "session": session, "controls": control_state(self.controls.state),
                "camera_frames": received, "page": self.report, "host_path": self.times.medians_ms(),
                "through": list(self._through)}

    def control(self, message: dict[str, Any]) -> str:
        command = command_for(message, self.controls.state.family)
        self.controls.put(command)
        return f"{command.name} sent"

    def camera_frame(self, picture: Any) -> None:
        if self.camera is not None:
            self.camera.put(picture)

    def page_report(self, report: dict[str, Any]) -> None:
        """What the driving page measured (glass to glass), kept for the state and the log; a value that is not
        a finite number is left out (NaN or Infinity in the state is JSON no page can parse)."""
        self.report = {k: report[k] for k in ("glass_to_glass_ms", "samples") if _finite(report.get(k))}


def _finite(value: Any) -> bool:
    """A JSON number a browser reads back as one: an int (of any size), or a float that is not NaN or infinite."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _fit(frame: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """An output frame at the page's size, RGB (an engine frame of another size is scaled, as the player does)."""
    w, h = size
    if frame.shape[:2] != (h, w):
        import cv2

        frame = cv2.resize(frame, (w, h), interpolation=cv2.INTER_AREA)
    return np.ascontiguousarray(frame[..., :3], dtype=np.uint8)


def _small(frame: np.ndarray) -> np.ndarray:
    import cv2

    h, w = frame.shape[:2]
    scale = PREVIEW_SIDE / max(h, w)
    if scale >= 1:
        return np.ascontiguousarray(frame[..., :3])
    size = (max(2, int(w * scale) // 2 * 2), max(2, int(h * scale) // 2 * 2))
    return cv2.resize(np.ascontiguousarray(frame[..., :3]), size, interpolation=cv2.INTER_AREA)
