"""A second input as the VACE control video (`loom play --control-input SOURCE`), frame-locked with the main one.

Each main frame goes to the engine with one control frame. From a file or the generated clip that is
the control input's next frame: the two advance together, so a render pairs frame i with control
frame i. From a camera or a stream it is the newest frame the control input's own reading thread has
(a live source runs at its own rate, and must never hold the main input up), the same one again
until a newer one comes. A control frame of another size than the output is fitted to it as the
main input is (a last odd row or column dropped, else scaled). A control input that ends or fails is
said once; from then on the frames go without one, the engine uses its grey control for them and
counts them as missing, and the show goes on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from loom_live.plugin.media.base import MediaError
from loom_live.plugin.media.generated_clip import generate_clip
from loom_live.plugin.media.sources import open_source
from loom_live.plugin.player.options import GENERATED_INPUT, PlayerError

GENERATED_SEED_OFFSET = 1  # the generated clip as a control input: other shapes than the main input's


def open_control_input(spec: str, size: tuple[int, int], *, frames: int, fps: float, seed: int,
                       say: Callable[[str], None]) -> ControlInput:
    """`--control-input SOURCE`: a camera index, a file, a stream URL, or the generated clip (`frames` of the
    output's `size`); one that cannot be opened ends the run before the engine starts, in one line."""
    try:
        source = (generate_clip(frames, size=size, fps=fps, seed=seed + GENERATED_SEED_OFFSET)
                  if spec == GENERATED_INPUT else open_source(spec))
    except MediaError as exc:
        raise PlayerError(f"--control-input: {exc}") from None
    return ControlInput(source, size, say)


class ControlInput:
    """Control frames for the main input's frames from an open `source`, fitted to the output size
    (width, height); `say` tells the user (once) that the input ended or is scaled."""

    def __init__(self, source: Any, size: tuple[int, int], say: Callable[[str], None]) -> None:
        self.source = source
        self.size = size
        self._say = say
        self.sent = 0  # main frames that got a control frame
        self.missing = 0  # main frames that went without one (the engine's grey control)
        self._ended = False
        self._told_scaled = False
        self._reader = _NewestFrame(source) if source.is_live else None

    @property
    def name(self) -> str:
        return self.source.name

    def next(self) -> np.ndarray | None:
        """The control frame for the main input's next frame, or None (the engine's grey control)."""
        frame = None if self._ended else self._read()
        if frame is None:
            self.missing += 1
            return None
        self.sent += 1
        return self._fit(frame)

    def _read(self) -> np.ndarray | None:
        if self._reader is not None:
            frame, why = self._reader.newest()
        else:
            try:
                frame = self.source.read()
                why = "it ended" if frame is None else ""
            except Exception as exc:  # whatever breaks the control input, the show goes on without it
                frame, why = None, f"it failed ({exc})"
        if why:
            self._ended = True
            self._say(f"control input {self.source.name}: {why} after {self.sent} frames; the frames go on "
                      "with the engine's grey control")
        return frame

    def _fit(self, frame: np.ndarray) -> np.ndarray:
        w, h = self.size
        fh, fw = frame.shape[:2]
        if (fh - fh % 2, fw - fw % 2) == (h, w):
            return frame[:h, :w]
        import cv2

        if not self._told_scaled:
            self._say(f"control input {fw}x{fh} scaled to the output's {w}x{h}")
            self._told_scaled = True
        return cv2.resize(frame, (w, h), interpolation=cv2.INTER_AREA)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        else:
            with contextlib.suppress(Exception):
                self.source.close()


class _NewestFrame:
    """A live source read on its own thread; `newest()` is the last frame it gave and, once it ended or
    failed, why. The source is used only from this thread and closed by it."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._frame: np.ndarray | None = None
        self._why = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loom-control-input", daemon=True)
        self._thread.start()

    def newest(self) -> tuple[np.ndarray | None, str]:
        with self._lock:
            return (None, self._why) if self._why else (self._frame, "")

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    frame = self._source.read()
                    why = "it ended" if frame is None else ""
                except Exception as exc:
                    frame, why = None, f"it failed ({exc})"
                with self._lock:
                    self._frame, self._why = frame, why
                if why:
                    return
        finally:
            with contextlib.suppress(Exception):
                self._source.close()

    def close(self, wait_s: float = 1.0) -> None:
        self._stop.set()
        self._thread.join(wait_s)
