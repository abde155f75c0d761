"""NDI in and out through cyndilib (the NDI runtime is bundled in its wheels).

NDI finds sources by mDNS. Where multicast does not reach (containers, some Wi-Fi, two subnets),
the NDI runtime reads extra addresses to ask from ``$NDI_CONFIG_DIR/ndi-config.v1.json``
(``{"ndi": {"networks": {"ips": "192.168.1.20,127.0.0.1"}}}``); the README shows how.
"""

from __future__ import annotations

import logging
import time
from fractions import Fraction
from types import ModuleType
from typing import Any

import numpy as np

from loom_live.host_bridge.wire import pixels
from loom_live.plugin.media.base import AppSink, FrameSource, MediaError, opaque_rgba, require

log = logging.getLogger(__name__)

RECEIVE_POLL_MS = 100
# NDI frame rates are fractions: 30000/1001 for 29.97; a float rate maps to the nearest such one.
MAX_RATE_DENOMINATOR = 1001


def _cyndilib() -> ModuleType:
    return require("cyndilib", "ndi", "NDI")


def list_sources(timeout_s: float = 3.0) -> list[str]:
    """Names of the NDI sources seen within ``timeout_s`` ("MACHINE (STREAM)")."""
    ndi = _cyndilib()
    finder = ndi.Finder()
    finder.open()
    try:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            finder.wait_for_sources(min(left, 0.5))
        return sorted(finder.get_source_names())
    finally:
        finder.close()


def matches(wanted: str, source_name: str) -> bool:
    """``wanted`` is the full "MACHINE (STREAM)" name or only STREAM (case-insensitive): a set-up
    that moves to another machine keeps working with the stream name alone."""
    wanted, full = wanted.strip().lower(), source_name.strip().lower()
    stream = full[full.find("(") + 1:-1] if full.endswith(")") and "(" in full else full
    return wanted in (full, stream)


class NdiSource(FrameSource):
    """A live NDI source as RGB frames; alpha is composited over black (NDI alpha is straight)."""

    def __init__(self, wanted: str, open_timeout: float, read_timeout: float) -> None:
        ndi = _cyndilib()
        from cyndilib.receiver import ReceiveFrameType

        self._video_type = ReceiveFrameType.recv_video
        self._read_timeout = read_timeout
        self._finder = ndi.Finder()
        self._finder.open()
        self._receiver: Any = None
        try:
            source = self._find(wanted, open_timeout)
            self._frame = ndi.VideoRecvFrame()
            self._receiver = ndi.Receiver(color_format=ndi.RecvColorFormat.RGBX_RGBA,
                                          bandwidth=ndi.RecvBandwidth.highest, recv_name="Loom")
            self._receiver.set_video_frame(self._frame)
            self._receiver.set_source(source)
            first = self._receive(open_timeout)
            if first is None:
                raise MediaError(f"NDI source {source.name!r} sent no picture within {open_timeout:g} s")
        except BaseException:
            self._close()
            raise
        self._pending: np.ndarray | None = first
        rate = self._frame.get_frame_rate()
        fps = float(rate) if rate else 30.0
        height, width = first.shape[:2]
        super().__init__(f"ndi://{source.name}", fps, width, height, None, is_live=True)

    def _find(self, wanted: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            for name in self._finder.get_source_names():
                if matches(wanted, name):
                    return self._finder.get_source(name)
            left = deadline - time.monotonic()
            if left <= 0:
                seen = ", ".join(repr(n) for n in self._finder.get_source_names()) or "none"
                raise MediaError(f"NDI source {wanted!r} not found within {timeout_s:g} s (sources seen: "
                                 f"{seen}; `loom play --list-ndi` lists them)")
            self._finder.wait_for_sources(min(left, 0.5))

    def _receive(self, timeout_s: float) -> np.ndarray | None:
        """The next video frame within ``timeout_s``, else None."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self._receiver.receive(self._video_type, RECEIVE_POLL_MS)
            if got & self._video_type:
                return self._to_rgb()
        return None

    def _to_rgb(self) -> np.ndarray:
        width, height = self._frame.get_resolution()
        stride = self._frame.get_line_stride() or width * 4
        raw = np.empty(self._frame.get_data_size(), np.uint8)
        self._frame.fill_p_data(raw)
        rgba = raw[: stride * height].reshape(height, stride)[:, : width * 4].reshape(height, width, 4)
        alpha = rgba[..., 3]
        if alpha.min() == 255:
            return pixels.to_engine(rgba, order="RGBA")
        return ((rgba[..., :3].astype(np.uint16) * alpha[..., None] + 127) // 255).astype(np.uint8)

    def _read(self) -> np.ndarray | None:
        if self._pending is not None:
            frame, self._pending = self._pending, None
            return frame
        frame = self._receive(self._read_timeout)
        if frame is None:  # the live feed reconnects: a sender that went away may come back
            raise MediaError(f"{self.name}: no picture for {self._read_timeout:g} s")
        return frame

    def _close(self) -> None:
        if self._receiver is not None:
            self._receiver.disconnect()
        self._finder.close()


class NdiSink(AppSink):
    """An NDI sender: BGRA with opaque alpha at the player's frame rate (receivers show NDI's clock)."""

    def __init__(self, name: str, fps: float, size: tuple[int, int]) -> None:
        super().__init__(f"ndi://{name}", fps, size)
        ndi = _cyndilib()
        self._sender = ndi.Sender(name, clock_video=True)
        frame = ndi.VideoSendFrame()
        frame.set_resolution(self.width, self.height)
        frame.set_fourcc(ndi.FourCC.BGRA)
        frame.set_frame_rate(Fraction(fps).limit_denominator(MAX_RATE_DENOMINATOR))
        self._sender.set_video_frame(frame)
        try:
            self._sender.open()
        except Exception as exc:
            raise MediaError(f"{self.name}: the NDI sender did not start: {exc}") from exc
        self._bgra: np.ndarray | None = None
        log.info("NDI sender %r open, %dx%d @ %g fps", name, self.width, self.height, fps)

    def _send(self, frame: np.ndarray) -> None:
        self._bgra = opaque_rgba(frame, self._bgra, bgr=True)
        if not self._sender.write_video(self._bgra.reshape(-1)):
            raise MediaError(f"{self.name}: the NDI runtime refused the frame")

    def _stop(self) -> None:
        self._sender.close()
