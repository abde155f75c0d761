"""The web host as the player sees it: the page beside a run, and the browser's camera as its input.

`loom play --web` starts a `WebHost` beside whatever the run reads and writes; `loom web` also takes
its input from the driving page's camera (`camera`). The player calls three hooks on its own
thread, none of which waits: `input_frame` (each frame read), `submitted` (the bridge's sequence
number for it), `output` (each frame written). With them the host posts the restyled picture
(stamped with the camera frame it came from, stamp.py) and a small input preview for the pages,
and answers the pages' state and controls (server.py) from the bridge and the player's controls.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from loom_live.plugin.player.controls import Controls
from loom_live.plugin.web import stamp
from loom_live.plugin.web.access import Access
from loom_live.plugin.web.camera import BrowserCamera
from loom_live.plugin.web.page_controls import command_for, control_state, schema
from loom_live.plugin.web.server import PageServer
from loom_live.plugin.web.tracks import FrameBoard

PREVIEW_SIDE = 160  # the input preview's longer side in pixels
PREVIEW_INTERVAL_S = 1 / 15
SEQ_MEMORY = 512  # sequence numbers whose stamps are kept until their output comes back


class WebHost:
    """The page server plus what it serves; `camera` is set when the page's camera is the input."""

    def __init__(self, access: Access, controls: Controls, size: tuple[int, int], fps: float, *,
                 camera: bool = False) -> None:
        self.access = access
        self.controls = controls
        self.size = size
        self.camera = BrowserCamera(size, fps) if camera else None
        self.bridge: Any = None
        self.output_board: FrameBoard
        self.preview_board: FrameBoard | None = None
        self.report: dict[str, Any] = {}
        self._stamps: OrderedDict[int, int] = OrderedDict()
        self._pending_stamp = 0
        self._last_seq = -1
        self._last_preview = 0.0
        self.server = PageServer(access, self._boards)

    def _boards(self, loop: asyncio.AbstractEventLoop) -> WebHost:
        self.output_board = FrameBoard(loop)
        self.preview_board = None if self.camera is not None else FrameBoard(loop)
        return self

    def start(self) -> str:
        """Listen; returns the address to open. RuntimeError when the address is taken."""
        self.server.start()
        return self.access.url(self.server.port)

    def attach(self, bridge: Any) -> None:
        """The run's bridge, once it exists: the pages' state reads it."""
        self.bridge = bridge

    def close(self) -> None:
        if self.camera is not None:
            self.camera.close()
        self.server.close()

    # --- the player's hooks (its thread) ---------------------------------------------------------

    def input_frame(self, frame: np.ndarray) -> None:
        """A frame the player read, about to be submitted."""
        self._pending_stamp = self.camera.stamp_of(frame) if self.camera is not None else 0
        now = time.monotonic()
        if self.preview_board is not None and now - self._last_preview >= PREVIEW_INTERVAL_S:
            self._last_preview = now
            self.preview_board.post(_small(frame))

    def submitted(self, seq: int) -> None:
        """The bridge numbered the frame last given to `input_frame` `seq`."""
        if self._pending_stamp:
            self._stamps[seq] = self._pending_stamp
            while len(self._stamps) > SEQ_MEMORY:
                self._stamps.popitem(last=False)

    def output(self, frame: np.ndarray, seq: int) -> None:
        """A frame the player wrote; `seq` the input it was restyled from (-1: a fallback, not restyled)."""
        if seq >= 0 and seq == self._last_seq:
            return  # the same restyled frame again (the loop runs at the input's rate): sent once
        self._last_seq = seq
        code = self._stamps.pop(seq, 0) if seq >= 0 else 0
        self.output_board.post(np.concatenate([frame, stamp.encode(code, frame.shape[1])], axis=0))

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
                      "message": status.message, "restarts": status.restarts, "frames_out": status.frames_out}
            report = stats.get("engine", {}).get("session") or {}
            session = {k: report.get(k) for k in ("prompt", "prompt_style", "prompt_blend", "steps", "noise_scale",
                                                  "lora_scales", "prompt_error")}
        received = self.camera.received if self.camera is not None else None
        return {"engine": engine, "session": session, "controls": control_state(self.controls.state),
                "camera_frames": received, "page": self.report}

    def control(self, message: dict[str, Any]) -> str:
        command = command_for(message)
        self.controls.put(command)
        return f"{command.name} sent"

    def camera_frame(self, picture: Any) -> None:
        if self.camera is not None:
            self.camera.put(picture)

    def page_report(self, report: dict[str, Any]) -> None:
        """What the driving page measured (glass to glass), kept for the state and the log."""
        self.report = {k: report[k] for k in ("glass_to_glass_ms", "samples")
                       if isinstance(report.get(k), (int, float)) and not isinstance(report.get(k), bool)}


def _small(frame: np.ndarray) -> np.ndarray:
    import cv2

    h, w = frame.shape[:2]
    scale = PREVIEW_SIDE / max(h, w)
    if scale >= 1:
        return np.ascontiguousarray(frame[..., :3])
    size = (max(2, int(w * scale) // 2 * 2), max(2, int(h * scale) // 2 * 2))
    return cv2.resize(np.ascontiguousarray(frame[..., :3]), size, interpolation=cv2.INTER_AREA)
