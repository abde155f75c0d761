"""Video in for the Loom player and ``loom eval``: files, cameras, network streams.

Every front end opens its input here, so that every one opens media the same way and fails the same way: a bad
input always ends in a ``MediaError`` whose message names the input and what is allowed, never in a hang or a
decoder traceback. Frames are uint8 RGB numpy arrays ``[H, W, 3]``, rows top-down.

No torch and no engine: the player runs in the host process. ``av`` (PyAV) and ``cv2`` are
imported inside the functions that need them, so importing this module costs neither.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loom_live.plugin.media.base import DEFAULT_OPEN_TIMEOUT_S, FrameSource, MediaError, reason

NETWORK_SOURCE_SCHEMES = ("rtsp", "rtsps", "srt", "udp", "rtmp", "rtmps", "http", "https", "tcp")
DEFAULT_READ_TIMEOUT_S = 5.0
# Cameras that report no rate (0) are assumed to run at this rate.
FALLBACK_CAMERA_FPS = 30.0
# Damaged packets in a row after which a source is declared unreadable (about 10 s of video at 25 fps):
# a few are skipped, as FFmpeg's own tools do, but a stream of nothing else must not spin silently.
MAX_BAD_PACKETS_IN_A_ROW = 250
# A display rotation (counter-clockwise degrees) as np.rot90's quarter turns.
QUARTER_TURNS = {90: 1, 180: 2, -180: 2, -90: 3, 270: 3}


class _AVSource(FrameSource):
    """A file or network stream decoded with PyAV; the first frame is decoded at open to prove it."""

    def __init__(self, name: str, target: str, is_url: bool, open_timeout: float, read_timeout: float):
        import av

        options = _network_input_options(target, read_timeout) if is_url else {}
        try:
            container = av.open(target, options=options,
                                timeout=(open_timeout, read_timeout) if is_url else None)
        except av.error.ExitError as e:
            raise MediaError(f"{name}: no answer within {open_timeout:g} s (is the stream running?)") from e
        except av.error.ProtocolNotFoundError as e:
            raise MediaError(f"{name}: this FFmpeg build (bundled with PyAV) does not support this "
                             "protocol") from e
        except av.error.InvalidDataError as e:
            raise MediaError(f"{name}: not a readable video (unknown or damaged format)") from e
        except (av.error.FFmpegError, OSError) as e:
            raise MediaError(f"{name}: cannot open: {reason(e)}") from e
        if not container.streams.video:
            container.close()
            raise MediaError(f"{name}: contains no video stream")
        self._container = container
        self._name = name
        self._timeout = read_timeout
        stream = container.streams.video[0]
        # Frame threads buffer several frames: fine for files, added latency for live streams.
        stream.thread_type = "SLICE" if is_url else "AUTO"
        self._frames = self._decoded(stream)
        try:
            first = self._decode_next()
        except MediaError:
            container.close()
            raise
        if first is None:
            container.close()
            raise MediaError(f"{name}: the video stream holds no decodable frame")
        self._pending: np.ndarray | None = first
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else FALLBACK_CAMERA_FPS
        count = None if is_url else _frame_count(stream, container, fps)
        height, width = first.shape[:2]
        super().__init__(name, fps, width, height, count, is_live=is_url)

    def _decoded(self, stream: Any) -> Iterator[Any]:
        """Frames packet by packet: a damaged packet mid-file is skipped and counted, not the end of the show."""
        import av

        bad_in_a_row = 0
        for packet in self._container.demux(stream):
            try:
                frames = packet.decode()
            except av.error.InvalidDataError as e:
                self.skipped_packets += 1
                bad_in_a_row += 1
                if bad_in_a_row >= MAX_BAD_PACKETS_IN_A_ROW:
                    raise MediaError(f"{self._name}: {bad_in_a_row} damaged packets in a row, no picture "
                                     f"(last: {reason(e)})") from e
                continue
            bad_in_a_row = 0
            yield from frames

    def _decode_next(self) -> np.ndarray | None:
        import av

        try:
            frame = next(self._frames)
        except StopIteration:
            return None
        except av.error.ExitError as e:
            raise MediaError(f"{self._name}: no data for {self._timeout:g} s (stream stopped?)") from e
        except (av.error.FFmpegError, OSError) as e:
            raise MediaError(f"{self._name}: decoding failed: {reason(e)}") from e
        return _upright(frame)

    def _read(self) -> np.ndarray | None:
        if self._pending is not None:
            frame, self._pending = self._pending, None
            return frame
        return self._decode_next()

    def _close(self) -> None:
        self._container.close()


def _upright(frame: Any) -> np.ndarray:
    """A decoded frame as players show it: a phone's portrait clip is stored sideways with a display
    rotation (VideoFrame.rotation, counter-clockwise degrees; an older PyAV lacks it), which decoding does
    not apply."""
    image = frame.to_ndarray(format="rgb24")
    turns = QUARTER_TURNS.get(getattr(frame, "rotation", 0), 0)  # another angle, or a broken matrix: as stored
    return np.ascontiguousarray(np.rot90(image, turns)) if turns else image


def _frame_count(stream: Any, container: Any, fps: float) -> int | None:
    """Frames in a file: as recorded by the container, else estimated from the duration."""
    if stream.frames:
        return int(stream.frames)
    if stream.duration and stream.time_base:
        return max(1, round(float(stream.duration * stream.time_base) * fps))
    if container.duration:
        return max(1, round(container.duration / 1e6 * fps))  # container.duration is in microseconds
    return None


class _CameraSource(FrameSource):
    """A camera through OpenCV; frames arrive BGR and are converted to RGB."""

    def __init__(self, index: int):
        import cv2

        name = f"camera {index}"
        with _quiet_opencv():
            capture = cv2.VideoCapture(index)
            ok = capture.isOpened()
            ok, first = capture.read() if ok else (False, None)
        if not ok or first is None:
            capture.release()
            raise MediaError(f"{name} could not be opened: no such device, or another program is using "
                             "it (camera indexes start at 0)")
        self._capture = capture
        self._pending: np.ndarray | None = cv2.cvtColor(first, cv2.COLOR_BGR2RGB)
        fps = capture.get(cv2.CAP_PROP_FPS)
        fps = fps if fps and math.isfinite(fps) and fps > 0 else FALLBACK_CAMERA_FPS
        height, width = first.shape[:2]
        super().__init__(name, fps, width, height, None, is_live=True)

    def _read(self) -> np.ndarray | None:
        import cv2

        if self._pending is not None:
            frame, self._pending = self._pending, None
            return frame
        ok, frame = self._capture.read()
        return cv2.cvtColor(frame, cv2.COLOR_BGR2RGB) if ok else None

    def _close(self) -> None:
        self._capture.release()


def open_source(spec: str | int | Path, *, open_timeout: float = DEFAULT_OPEN_TIMEOUT_S,
                read_timeout: float = DEFAULT_READ_TIMEOUT_S) -> FrameSource:
    """Open a video file, a camera (an int or a digit string) or a stream URL.

    URLs: rtsp, srt, udp, rtmp, http(s), tcp (PyAV/FFmpeg), ndi://SOURCE (cyndilib). Network inputs give up after
    ``open_timeout`` seconds without an answer and ``read_timeout`` seconds without data.
    """
    if isinstance(spec, bool):
        raise MediaError(f"source must be a file path, a camera index or a URL, got {spec!r}")
    if isinstance(spec, int) or (isinstance(spec, str) and spec.strip().isdigit()):
        return _CameraSource(int(spec))
    if isinstance(spec, str) and "://" in spec:
        scheme = spec.split("://", 1)[0].lower()
        if scheme == "file":
            return _open_file(Path(spec.split("://", 1)[1]))
        if scheme == "ndi":
            from loom_live.plugin.media.ndi import NdiSource

            return NdiSource(spec.split("://", 1)[1], open_timeout, read_timeout)
        if scheme not in NETWORK_SOURCE_SCHEMES:
            raise MediaError(f"unsupported URL scheme {scheme!r} in {spec!r}; allowed: "
                             f"{', '.join(NETWORK_SOURCE_SCHEMES)}")
        return _AVSource(spec, spec, True, open_timeout, read_timeout)
    if isinstance(spec, (str, Path)):
        return _open_file(Path(spec))
    raise MediaError(f"source must be a file path, a camera index or a URL, got {type(spec).__name__}")


def _open_file(path: Path) -> FrameSource:
    if not path.exists():
        raise MediaError(f"video file not found: {path}")
    if path.is_dir():
        raise MediaError(f"not a video file: {path} is a directory")
    if not path.is_file():  # a FIFO or a device: opening one can block with no writer, beyond any timeout
        raise MediaError(f"not a video file: {path} is not a regular file (a pipe or a device); expected a video "
                         "file, a camera index, or a stream URL (rtsp://, srt://, udp://, ...)")
    return _AVSource(str(path), str(path), False, DEFAULT_OPEN_TIMEOUT_S, DEFAULT_READ_TIMEOUT_S)


def _network_input_options(url: str, timeout_s: float) -> dict[str, str]:
    """Socket-level timeouts in microseconds (RTSP names its own option) on top of PyAV's."""
    micros = str(int(timeout_s * 1e6))
    if url.lower().startswith(("rtsp://", "rtsps://")):
        return {"timeout": micros}
    return {"rw_timeout": micros}


@contextlib.contextmanager
def _quiet_opencv() -> Iterator[None]:
    """Silence OpenCV's backend warnings while probing a camera (the MediaError says it all)."""
    import cv2

    log = getattr(getattr(cv2, "utils", None), "logging", None)
    if log is None:
        yield
        return
    level = log.getLogLevel()
    log.setLogLevel(log.LOG_LEVEL_SILENT)
    try:
        yield
    finally:
        log.setLogLevel(level)
