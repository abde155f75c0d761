"""Video in and out for the Loom player and ``loom eval``: files, cameras, network streams.

One module so that every front end opens media the same way and fails the same way: a bad
input always ends in a ``MediaError`` whose message names the input and what is allowed, never
in a hang or a decoder traceback. Frames are uint8 RGB numpy arrays ``[H, W, 3]``, rows top-down.

No torch and no engine: the player runs in the host process. ``av`` (PyAV) and ``cv2`` are
imported inside the functions that need them, so importing this module costs neither.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import queue
import signal
import stat
import threading
import time
import weakref
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from loom_live.plugin.media.base import FrameSource, MediaError

log = logging.getLogger(__name__)

# The frame rates an output is written at: a file's time base holds them, and players decode them.
SINK_FPS_RANGE = (0.01, 1000.0)
# Signals that end a run, held back while encoded packets or a file's trailer are written (signals_deferred).
DEFERRED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

NETWORK_SOURCE_SCHEMES = ("rtsp", "rtsps", "srt", "udp", "rtmp", "rtmps", "http", "https", "tcp")
NETWORK_SINK_FORMATS = {"udp": "mpegts", "srt": "mpegts", "rtmp": "flv", "rtmps": "flv"}
PORTED_SINK_SCHEMES = ("udp", "srt")  # outputs with no default port (RTMP's is 1935)
FILE_SINK_SUFFIXES = (".mp4", ".mkv", ".mov")
DEFAULT_OPEN_TIMEOUT_S = 10.0
DEFAULT_READ_TIMEOUT_S = 5.0
# 7 MPEG-TS packets of 188 bytes: the UDP datagram size VLC, OBS and TouchDesigner expect.
UDP_TS_PACKET_SIZE = 1316
# Cameras that report no rate (0) are assumed to run at this rate.
FALLBACK_CAMERA_FPS = 30.0
# x264 `fast`: `veryfast` (crf 17) would cost a third less CPU beside the engine, but a file it was
# writing when Ctrl-C came was left with no decodable frame in 4 of 7 tries (test_video_io's Ctrl-C test).
FILE_ENCODER_OPTIONS = {"preset": "fast", "crf": "18"}
NETWORK_ENCODER_OPTIONS = {"preset": "veryfast", "tune": "zerolatency", "crf": "23"}
# A network output's receiver that stops taking data (a network gone, a stuck server) blocks FFmpeg's send until
# TCP gives up, a quarter of an hour later: one that takes no frame for this long is declared failed.
NETWORK_STALL_S = 5.0
# A stop (Ctrl-C, SIGTERM, quit) waits this long, not NETWORK_STALL_S, for a network output's receiver that takes
# nothing: its last frames are not worth the user's wait (a file is still finished in full).
STOP_GRACE_S = 0.5
STOP_POLL_S = 0.05  # how often a write held up by such a receiver looks for a stop (FrameSink.stop)
NETWORK_QUEUE_FRAMES = 4  # frames handed to a network output's thread, not sent yet: a file run waits beyond
# RTMP outputs open through FFmpeg's tee muxer, the one way PyAV passes options to an output's connection: its
# rw_timeout bounds the connect, the RTMP handshake and each send. PyAV's own timeout= bounds inputs only, and PyAV
# holds the GIL while an output connects, so a server that took the connection and never answered froze the run.
TEE_SINK_SCHEMES = ("rtmp", "rtmps")
# Audio codecs an MP4 muxer accepts on paper but most players cannot play: re-encoded to AAC.
MP4_REENCODE_AUDIO_PREFIXES = ("pcm_", "vorbis")
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
            raise MediaError(f"{name}: cannot open: {_reason(e)}") from e
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
                                     f"(last: {_reason(e)})") from e
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
            raise MediaError(f"{self._name}: decoding failed: {_reason(e)}") from e
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


class _GeneratedSource(FrameSource):
    """Deterministic moving shapes over a drifting gradient, rendered on demand (constant memory).

    Textured squares and smooth discs give optical flow something to track, and the whole clip
    depends only on (size, seed, frame index), so tests and first runs see the same frames.
    """

    def __init__(self, n_frames: int, width: int, height: int, fps: float, seed: int):
        super().__init__(f"generated clip (seed {seed})", fps, width, height, n_frames, is_live=False)
        rng = np.random.default_rng(seed)
        n_shapes = 6
        self._pos = rng.uniform(0.1, 0.9, (n_shapes, 2)) * (width, height)
        self._vel = rng.uniform(1.5, 5.0, (n_shapes, 2)) * rng.choice([-1.0, 1.0], (n_shapes, 2))
        self._radius = rng.uniform(0.06, 0.14, n_shapes) * min(width, height)
        self._colour = rng.uniform(30, 255, (n_shapes, 3))
        self._square = rng.random(n_shapes) < 0.5
        self._phase = rng.uniform(0, 2 * np.pi, 3)
        self._y = np.arange(height, dtype=np.float32)[:, None]  # pixel rows and columns, broadcast
        self._x = np.arange(width, dtype=np.float32)[None, :]
        self._index = 0

    def frame(self, t: int) -> np.ndarray:
        """Frame number ``t`` (any t >= 0, also beyond ``frame_count``).

        Each shape is drawn only inside its bounding box: a player run or a benchmark reads this
        clip as its input, and drawing every shape over the whole frame cost more than the engine's
        pass-through path."""
        w, h = self.width, self.height
        u, v = self._x / w, self._y / h
        img = np.empty((h, w, 3), np.float32)
        for c in range(3):
            wave = 2 * np.pi * (u * (c + 1) * 0.5 + v * 0.7 + 0.01 * t) + self._phase[c]
            img[..., c] = 90 + 60 * np.sin(wave)
        img = img.astype(np.float64)  # the shapes' colours are float64
        shapes = zip(self._pos, self._vel, self._radius, self._colour, self._square)
        for pos, vel, r, colour, square in shapes:
            cx = _bounce(pos[0] + vel[0] * t, r, w - r)
            cy = _bounce(pos[1] + vel[1] * t, r, h - r)
            rows = slice(max(0, int(np.floor(cy - r))), min(h, int(np.ceil(cy + r)) + 1))
            cols = slice(max(0, int(np.floor(cx - r))), min(w, int(np.ceil(cx + r)) + 1))
            dx, dy = self._x[:, cols] - cx, self._y[rows] - cy
            if square:
                mask = (np.abs(dx) < r) & (np.abs(dy) < r)
                checker = ((np.floor(dx / (r / 3)) + np.floor(dy / (r / 3))) % 2)[..., None]
                fill = colour * (0.55 + 0.45 * checker)
            else:
                mask = dx * dx + dy * dy < r * r
                fill = colour * (1.0 - 0.4 * np.sqrt(dx * dx + dy * dy)[..., None] / r)
            box = img[rows, cols]
            box[...] = np.where(mask[..., None], fill, box)
        return np.clip(img, 0, 255).astype(np.uint8)

    def _read(self) -> np.ndarray | None:
        if self._index >= (self.frame_count or 0):
            return None
        self._index += 1
        return self.frame(self._index - 1)


def _bounce(x: float, lo: float, hi: float) -> float:
    """Position moving back and forth between lo and hi (a triangle wave of the free path)."""
    span = hi - lo
    if span <= 0:
        return (lo + hi) / 2
    x = (x - lo) % (2 * span)
    return lo + (x if x <= span else 2 * span - x)


def generate_clip(n_frames: int = 120, size: tuple[int, int] = (832, 480), fps: float = 24.0,
                  seed: int = 0) -> FrameSource:
    """A built-in test clip: ``n_frames`` of moving shapes at ``size`` = (width, height)."""
    if n_frames < 1:
        raise MediaError(f"generated clip: n_frames must be >= 1, got {n_frames}")
    width, height = _check_size(size, "generated clip")
    if not fps > 0:
        raise MediaError(f"generated clip: fps must be > 0, got {fps}")
    return _GeneratedSource(n_frames, width, height, float(fps), seed)


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


# ----------------------------------------------------------------------------------------------
# Sinks


_OPEN_SINKS: weakref.WeakSet[FrameSink] = weakref.WeakSet()


@atexit.register
def _close_open_sinks() -> None:
    """Finalise files a program forgot to close, so they still play."""
    for sink in list(_OPEN_SINKS):
        with contextlib.suppress(Exception):
            sink.close()


def partial_path(path: Path) -> Path:
    """Where a file output is written until it is finalised: beside the target (same drive, so the
    final rename is atomic), hidden, with the target's suffix (FFmpeg picks the container from it)."""
    return path.with_name(f".{path.stem}.loom-partial{path.suffix}")


def aside_path(path: Path, n: int) -> Path:
    """The ``n``-th name beside ``path`` for a finished file that must not replace one made there during the run."""
    return path.with_name(f"{path.stem}.loom-{n}{path.suffix}")


def _move_without_replacing(src: Path, dst: Path) -> None:
    """Move ``src`` to ``dst`` in one step that raises FileExistsError where ``dst`` exists: a hard link then the
    unlink of ``src``; where the file system has no hard links (FAT, some network drives), ``dst`` claimed empty
    with O_EXCL, then replaced by ``src``. Either way a file made at ``dst`` meanwhile is never replaced."""
    try:
        os.link(src, dst)
        linked = True
    except FileExistsError:
        raise
    except OSError:
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        linked = False
    try:
        if linked:
            src.unlink()
        else:
            os.replace(src, dst)
    except OSError:
        with contextlib.suppress(OSError):
            dst.unlink()  # our own link or claim: the partial stays, and the caller says so
        raise


def _claim_partial(partial: Path, name: str) -> int | None:
    """Lock a file output's partial for this run before FFmpeg truncates it; returns the descriptor that holds
    the lock until the output is finished or discarded.

    Two runs writing one output opened the same partial: both wrote into one file, which the first to finish
    moved onto the target (mixed, undecodable) while the other's recording was lost. A partial a run left when
    it was killed holds no lock and is taken over. Nothing is locked where flock is missing (Windows), fails
    (a file system without locks), or where the partial is not a regular file."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(partial, os.O_RDONLY | os.O_CREAT | os.O_NONBLOCK, 0o666)  # non-blocking: a FIFO opens at once
    except OSError as e:
        raise MediaError(f"{name}: cannot open for writing: {_reason(e)}") from e
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
    except BlockingIOError:
        os.close(fd)
        raise MediaError(f"{name}: another run is writing this file now (its partial {partial.name} is in use); "
                         "let it finish, or give another -o") from None
    except OSError:
        pass
    os.close(fd)
    return None


class FrameSink:
    """H.264 (yuv420p) output to a file or a network stream; build it with ``open_sink``.

    The size is fixed at open. ``close()`` flushes the encoder and writes the container
    trailer; it runs even when the program is interrupted (use ``with`` or ``finally``), and a
    second Ctrl-C during ``close()`` is held back until the file is complete.

    A file is written to ``partial_path(target)`` and renamed onto the target only by a ``close()``
    that finalises it with at least one frame: a run that fails, or stops before its first frame,
    leaves whatever was at the target as it was. Without ``overwrite`` a file that appeared at the target
    during the run is never replaced either: the finished file goes beside it (``kept_at``).
    """

    def __init__(self, name: str, target: str, container_format: str | None, is_network: bool,
                 fps: float, width: int, height: int, audio_from: Path | None,
                 open_timeout: float = DEFAULT_OPEN_TIMEOUT_S, overwrite: bool = True):
        import av

        self.name = name
        self.fps = fps
        self.width = width
        self.height = height
        self.is_network = is_network
        self.frames_written = 0
        self.closed = False
        self.stopping = False  # a stop is on its way (stop): no write or close waits on a receiver for long
        self._final: Path | None = None if is_network else Path(target)
        self._overwrite = overwrite
        self.kept_at: Path | None = None  # where a closed file's frames are: its target, or beside it (close)
        self._partial: Path | None = None if is_network else partial_path(Path(target))
        self._lock = None if self._partial is None else _claim_partial(self._partial, name)
        self._settled = False  # the partial was moved or removed: its name may be another run's now
        self._left = ""  # the partial could not be removed: what discard() adds to the output's failure line
        try:
            self._container = av.open(str(self._partial) if self._partial else target, "w", format=container_format)
        except (av.error.FFmpegError, OSError) as e:
            self._discard_partial()
            raise MediaError(f"{name}: cannot open for writing: {_reason(e)}") from e
        try:
            self._video = self._add_video_stream(fps, width, height)
            self._audio = _AudioPassThrough(self._container, audio_from, Path(target).suffix.lower()) \
                if audio_from is not None else None
            self._container.start_encoding()  # connect / write the header now, so errors show at open
        except av.error.ProtocolNotFoundError as e:
            self._abort()
            self._discard_partial()
            raise MediaError(f"{name}: this FFmpeg build (bundled with PyAV) does not support this "
                             "protocol; use udp:// or rtmp://, or a PyAV built with it") from e
        except TimeoutError as e:  # a network output's server that never answered (see TEE_SINK_SCHEMES)
            self._abort()
            self._discard_partial()
            raise MediaError(f"{name}: no answer within {open_timeout:g} s; check that the streaming server is "
                             "running and that this is its address and port (a firewall, or another service on "
                             "that port that takes the connection but never answers, looks the same)") from e
        except (av.error.FFmpegError, OSError) as e:
            self._abort()
            self._discard_partial()
            raise MediaError(f"{name}: cannot start the output: {_reason(e)}") from e
        _OPEN_SINKS.add(self)
        self._sender = _NetworkSender(self) if is_network else None

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.width, self.height

    def stop(self) -> None:
        """A stop is on its way (a quit, or a signal held back by signals_deferred): a write that waits on a network
        output's receiver that takes nothing gives up within STOP_POLL_S, dropping its frame, and ``close`` waits
        STOP_GRACE_S, not NETWORK_STALL_S. Safe from any thread and from a signal handler: it only sets a flag, which
        that write polls (an Event's lock, taken again by a handler on the thread that holds it, would hang)."""
        self.stopping = True

    def _add_video_stream(self, fps: float, width: int, height: int) -> Any:
        import av

        rate = Fraction(fps).limit_denominator(1001)
        codec = "libx264" if "libx264" in av.codecs_available else "h264"
        options = dict(NETWORK_ENCODER_OPTIONS if self.is_network else FILE_ENCODER_OPTIONS) \
            if codec == "libx264" else {}
        if self._container.format.name == "tee":  # FLV wants the codec's header apart: PyAV asks so for flv only
            options["flags"] = "+global_header"
        stream = self._container.add_stream(codec, rate=rate, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if self.is_network:
            # A keyframe every second, so a player that joins late starts within a second.
            stream.codec_context.gop_size = max(1, round(fps))
        return stream

    def write(self, frame: np.ndarray) -> None:
        """Encode one uint8 RGB frame ``[H, W, 3]`` of the sink's size."""
        import av

        if self.closed:
            raise MediaError(f"{self.name}: sink is closed")
        _check_frame(frame, self.width, self.height, self.name)
        if self._sender is not None:
            if self._sender.put(frame):  # else dropped: a stop came while the receiver took nothing
                self.frames_written += 1
            return
        try:
            with signals_deferred():  # the packets an encode returns are muxed before a Ctrl-C ends the run
                self._encode(frame, self.frames_written)
                self.frames_written += 1
            if self._audio is not None:
                self._audio.copy_until(self.frames_written / self.fps)
        except (av.error.FFmpegError, OSError) as e:
            raise MediaError(f"{self.name}: writing failed: {_reason(e)}") from e

    def _encode(self, frame: np.ndarray, pts: int) -> None:
        import av

        video_frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        video_frame.pts = pts
        self._container.mux(self._video.encode(video_frame))

    def close(self, keep: bool = True, stopping: bool = False) -> None:
        """Flush the encoder, finish the audio up to the video's end, write the trailer, and move a
        file onto its target; ``keep=False`` (a failed run) discards a file instead.

        A file without frames is never kept: it would replace the target with nothing playable.
        Raises MediaError when finishing fails (a full disk, a vanished drive): FFmpeg buffers its
        writes, so this is often the first moment such a failure shows; the target is then left as it was.
        ``stopping``: the user stopped the run (as ``stop``), so a network output whose receiver takes nothing is
        given up on after STOP_GRACE_S rather than NETWORK_STALL_S; a file is finished in full all the same.
        """
        import av

        if self.closed:
            return
        self.closed = True
        _OPEN_SINKS.discard(self)
        if stopping:
            self.stop()
        wait_s = STOP_GRACE_S if self.stopping else NETWORK_STALL_S
        if self._sender is not None and not self._sender.finish(wait_s):  # its thread is stuck inside the container
            raise MediaError(f"{self.name}: stopped; the receiver took nothing for {wait_s:g} s")
        with signals_deferred():
            try:
                try:
                    self._container.mux(self._video.encode(None))
                    if self._audio is not None:
                        self._audio.finish(self.frames_written / self.fps)
                finally:
                    self._abort()
            except (av.error.FFmpegError, OSError) as e:
                left = self._discard_partial()
                raise MediaError(f"{self.name}: finishing the output failed: {_reason(e)}; "
                                 f"nothing was written to it{left}") from e
            if self._partial is None:
                return
            if not keep or self.frames_written == 0:
                self._discard_partial()
                return
            try:
                self.kept_at = self._move_into_place()
            except OSError as e:
                left = self._discard_partial()
                raise MediaError(f"{self.name}: cannot move the finished file into place: {_reason(e)}{left}") from e
            self._release()
            if self.kept_at != self._final:
                log.warning("%s: a file appeared there during the run and is left as it was; this run's output is "
                            "%s (give --overwrite (-y) to replace such a file)", self.name, self.kept_at)

    def discard(self) -> str:
        """Stop without keeping anything: a file's target is left as it was (a network stream just ends).

        Returns what to add to the output's failure line: the hidden partial left behind when removing it
        failed too (a drive gone read-only), else "" (the user must not be left a file they were never told of)."""
        with contextlib.suppress(MediaError):
            self.close(keep=False)
        self._discard_partial()
        return self._left

    def _move_into_place(self) -> Path:
        """Move the finished partial onto the target, or, without overwrite, beside a file that appeared there
        during the run (the check at open cannot see it): as ``aside_path(target, n)``, the first n free. Each
        try is one step that fails where the name is taken, not a check then a rename that a file made between
        the two would be lost to. Returns where the file went."""
        if self._overwrite:
            os.replace(self._partial, self._final)
            return self._final
        n = 0
        while True:
            target = self._final if n == 0 else aside_path(self._final, n)
            try:
                _move_without_replacing(self._partial, target)
                return target
            except FileExistsError:
                n += 1

    @property
    def kept(self) -> bool:
        """Whether this sink's frames were delivered: streamed, or a closed file moved into place (``kept_at``)."""
        return self.closed and self.frames_written > 0 and (self._partial is None or self.kept_at is not None)

    @property
    def written_to(self) -> str:
        """What the run's report names as this output: a file moved aside (see close) by where it is."""
        if self.kept_at is None or self.kept_at == self._final:
            return self.name
        return f"{self.kept_at} ({self.name} appeared during the run and was left as it was)"

    def _discard_partial(self) -> str:
        """Remove the partial file; what to add to the error when it cannot be (a drive gone read-only): the
        user is told of the hidden file left behind, and where it is."""
        left = ""
        if self._partial is not None and not self._settled:
            try:
                self._partial.unlink(missing_ok=True)
            except OSError as e:
                log.warning("%s: cannot remove the unfinished file %s: %s", self.name, self._partial, _reason(e))
                left = self._left = f"; {self._partial} is left behind (removing it failed too)"
        self._release()
        return left

    def _release(self) -> None:
        """Let another run write this output: only once the partial is gone (moved or removed), or a run
        starting now would take over a file that is still to be moved or removed."""
        self._settled = True
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _abort(self) -> None:
        with contextlib.suppress(Exception):
            if getattr(self, "_audio", None) is not None:
                self._audio.close()
        self._container.close()

    def __enter__(self) -> FrameSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FrameSink {self.name!r} {self.width}x{self.height} @ {self.fps:g} fps>"


class _NetworkSender:
    """Encodes and sends a network output's frames on a thread of its own, so that a receiver that stops taking
    them stalls that output for at most NETWORK_STALL_S, not the show until TCP gives up."""

    def __init__(self, sink: FrameSink) -> None:
        self._sink = sink
        self._queue: queue.Queue[np.ndarray | None] = queue.Queue(NETWORK_QUEUE_FRAMES)
        self._error: str | None = None
        self._stalled = False
        self._thread = threading.Thread(target=self._run, name=f"loom output {sink.name}", daemon=True)
        self._thread.start()

    def put(self, frame: np.ndarray) -> bool:
        """Queue one frame; a failed send, or a receiver that took nothing for NETWORK_STALL_S, is a MediaError.

        False: the frame was dropped, as a stop came (FrameSink.stop) while the receiver took nothing; the stop
        then ends the output (finish) without the wait."""
        if self._error is not None:
            raise MediaError(f"{self._sink.name}: writing failed: {self._error}")
        frame = frame.copy()
        deadline = time.monotonic() + NETWORK_STALL_S
        while True:
            try:
                self._queue.put(frame, timeout=max(0.0, min(STOP_POLL_S, deadline - time.monotonic())))
                return True
            except queue.Full:
                pass
            if self._sink.stopping:
                return False
            if time.monotonic() >= deadline:
                self._stalled = True
                raise MediaError(f"{self._sink.name}: the receiver took nothing for {NETWORK_STALL_S:g} s "
                                 "(is it still there?)")

    def finish(self, wait_s: float) -> bool:
        """Send what is queued and end the thread, waiting at most ``wait_s`` for the receiver; False when the
        thread is stuck sending: it is left to FFmpeg's own timeout, holding the container, which is its own."""
        deadline = time.monotonic() + wait_s
        if not self._stalled and self._error is None:
            try:
                self._queue.put(None, timeout=wait_s)
            except queue.Full:
                self._stalled = True
        if not self._stalled:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _run(self) -> None:
        import av

        pts = 0
        while (frame := self._queue.get()) is not None:
            try:
                self._sink._encode(frame, pts)
            except (av.error.FFmpegError, OSError) as e:
                self._error = _reason(e)
                return
            pts += 1


class _AudioPassThrough:
    """Copies the first audio stream of a file into the output as the video advances.

    Packets are copied when the output container accepts the codec and re-encoded to AAC
    otherwise. Audio is cut where the video ends (a run stopped early stays in sync) and is
    aligned to the source's first video frame.
    """

    def __init__(self, output: Any, source: Path, out_suffix: str):
        import av

        self._input = av.open(str(source))
        self._stream = self._input.streams.audio[0]
        codec = self._stream.codec_context.name
        copy = codec in output.supported_codecs and not (
            out_suffix == ".mp4" and codec.startswith(MP4_REENCODE_AUDIO_PREFIXES))
        if copy:
            self._out = output.add_stream_from_template(self._stream)
            self._encoder = None
        else:
            # AAC needs a named channel layout; more than two channels are mixed down to stereo.
            layout = "mono" if self._stream.codec_context.layout.nb_channels == 1 else "stereo"
            self._out = output.add_stream("aac", rate=self._stream.codec_context.sample_rate, layout=layout)
            self._encoder = self._out
        self._output = output
        video = self._input.streams.video
        origin = video[0].start_time * video[0].time_base if video and video[0].start_time else 0
        self._origin_s = float(origin)
        self._packets = self._input.demux(self._stream)
        self._held: Any = None
        self._exhausted = False

    def copy_until(self, until_s: float) -> None:
        """Move every source packet that starts before ``until_s`` (output time) to the output."""
        while not self._exhausted:
            packet = self._held or next(self._packets, None)
            self._held = None
            if packet is None:
                self._exhausted = True
                return
            if packet.pts is None or packet.size == 0:
                continue
            source_s = float(packet.pts * packet.time_base)
            start_s = source_s - self._origin_s
            if start_s >= until_s:
                self._held = packet
                return
            if start_s < 0 <= source_s:
                continue  # audio from before the first video frame (codec priming, pts < 0, stays)
            self._emit(packet)

    def _emit(self, packet: Any) -> None:
        if self._encoder is None:
            shift = round(self._origin_s / packet.time_base)
            packet.pts -= shift
            if packet.dts is not None:
                packet.dts -= shift
            packet.stream = self._out
            self._output.mux(packet)
            return
        for frame in packet.decode():
            frame.pts = None  # the encoder numbers its own samples from 0
            self._output.mux(self._encoder.encode(frame))

    def finish(self, end_s: float) -> None:
        self.copy_until(end_s)
        if self._encoder is not None:
            self._output.mux(self._encoder.encode(None))

    def close(self) -> None:
        self._input.close()


def open_sink(spec: str | Path, fps: float, size: tuple[int, int],
              audio_from: str | int | Path | None = None, overwrite: bool = True, *,
              open_timeout: float = DEFAULT_OPEN_TIMEOUT_S) -> FrameSink:
    """Open an H.264 output: a .mp4/.mkv/.mov file, or udp:// / srt:// (MPEG-TS), rtmp:// (FLV); or an
    application output (ndi://, spout://, syphon://, virtualcam: see ``plugin.media.app_io``).

    ``size`` is (width, height), both even (yuv420p). ``audio_from``: the source spec whose
    audio should go into a file output; ignored for cameras, URLs and network outputs, and when
    the source has no audio. A file output is never the ``audio_from`` file, and with
    ``overwrite=False`` never an existing file (see ``check_output_file``). An RTMP server that
    leaves the connection or a send unanswered for ``open_timeout`` seconds fails the output. Without
    ``overwrite`` a file that appears at the target during the run is not replaced either (``FrameSink.kept_at``).
    """
    from loom_live.plugin.media.app_io import is_app_output, open_app_sink

    width, height = _check_size(size, f"output {spec}")
    if not (isinstance(fps, (int, float, Fraction)) and math.isfinite(fps) and fps > 0):
        raise MediaError(f"output {spec}: fps must be a positive number, got {fps!r}")
    if not SINK_FPS_RANGE[0] <= fps <= SINK_FPS_RANGE[1]:  # beyond, MP4 writes frames no player decodes
        raise MediaError(f"output {spec}: {fps:g} fps is outside what a video file holds; allowed "
                         f"{SINK_FPS_RANGE[0]:g} to {SINK_FPS_RANGE[1]:g} fps (give --fps)")
    spec_str = str(spec)
    if is_app_output(spec_str):  # raw frames to another application: any size
        return open_app_sink(spec_str, float(fps), (width, height))
    if width % 2 or height % 2:
        raise MediaError(f"output {spec}: H.264 yuv420p needs an even width and height, got {width}x{height}")
    if "://" in spec_str:
        scheme = spec_str.split("://", 1)[0].lower()
        if scheme not in NETWORK_SINK_FORMATS:
            raise MediaError(f"unsupported output URL scheme {scheme!r} in {spec_str!r}; allowed: "
                             f"{', '.join(NETWORK_SINK_FORMATS)} (or a {'/'.join(FILE_SINK_SUFFIXES)} file)")
        _check_port(spec_str, scheme)
        target, container_format = spec_str, NETWORK_SINK_FORMATS[scheme]
        if scheme == "udp" and "?" not in target:
            target += f"?pkt_size={UDP_TS_PACKET_SIZE}"
        if scheme in TEE_SINK_SCHEMES:
            target, container_format = _tee_output(target, container_format, open_timeout), "tee"
        return FrameSink(spec_str, target, container_format, True, float(fps), width, height, None,
                         open_timeout)
    path = Path(spec).expanduser()
    if path.suffix.lower() not in FILE_SINK_SUFFIXES:
        raise MediaError(f"output file {path} must end in one of {', '.join(FILE_SINK_SUFFIXES)}")
    check_output_file(path, [audio_from] if audio_from is not None else [], overwrite)
    return FrameSink(str(path), str(path), None, False, float(fps), width, height, _audio_file(audio_from),
                     overwrite=overwrite)


def _tee_output(url: str, container_format: str, timeout_s: float) -> str:
    """The tee muxer's name for one output ``url`` in ``container_format`` whose every wait on the server (connect,
    handshake, send) gives up after ``timeout_s``; the tee reads its names as FFmpeg tokens, hence the escapes."""
    escaped = "".join("\\" + ch if ch in "\\'|" else ch for ch in url)
    return f"[f={container_format}:rw_timeout={int(timeout_s * 1e6)}]{escaped}"


def _check_port(spec: str, scheme: str) -> None:
    """udp:// and srt:// send to (or, as an SRT listener, wait on) one port: without one FFmpeg opened the output
    and sent nothing, and the run failed 5 s in saying the receiver took nothing."""
    if scheme not in PORTED_SINK_SCHEMES:
        return
    try:
        port = urlsplit(spec).port
    except ValueError:  # not a number, or beyond 65535
        port = None
    if not port:
        raise MediaError(f"output {spec}: expected {scheme}://HOST:PORT with a port of 1 to 65535, e.g. "
                         f"{scheme}://127.0.0.1:5000")


def check_output_file(path: str | Path, inputs: list[str | int | Path], overwrite: bool) -> None:
    """Refuse an output file that is one of ``inputs`` (always), or that exists (unless ``overwrite``),
    the way ffmpeg refuses without ``-y``: a user's file is never replaced by surprise."""
    path = Path(path).expanduser()
    if not path.parent.is_dir():
        raise MediaError(f"output folder does not exist: {path.parent}")
    if path.is_dir():
        raise MediaError(f"output {path} is a folder; give a file in it, such as {path / 'out.mp4'}")
    for spec in inputs:
        if isinstance(spec, int) or "://" in str(spec) or not Path(spec).expanduser().exists():
            continue
        if path.exists() and os.path.samefile(path, Path(spec).expanduser()):
            raise MediaError(f"output {path} is the input file; write to another file "
                             "(the input is read while the output is written)")
    if path.exists() and not overwrite:
        raise MediaError(f"output {path} exists; give --overwrite (-y) to replace it, or another -o")


def _audio_file(audio_from: str | int | Path | None) -> Path | None:
    """The file to take audio from, or None when ``audio_from`` is not a file with audio."""
    import av

    if audio_from is None or isinstance(audio_from, int) or "://" in str(audio_from) \
            or str(audio_from).strip().isdigit():
        return None
    path = Path(audio_from)
    if not path.is_file():
        raise MediaError(f"audio source not found: {path}")
    try:
        with av.open(str(path)) as probe:
            return path if probe.streams.audio else None
    except (av.error.FFmpegError, OSError) as e:
        raise MediaError(f"audio source {path}: cannot open: {_reason(e)}") from e


# ----------------------------------------------------------------------------------------------
# Helpers


def _check_size(size: tuple[int, int], what: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in size)
    except (TypeError, ValueError):
        raise MediaError(f"{what}: size must be (width, height), got {size!r}") from None
    if width < 2 or height < 2:
        raise MediaError(f"{what}: size must be at least 2x2, got {width}x{height}")
    return width, height


def _check_frame(frame: np.ndarray, width: int, height: int, what: str) -> None:
    if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8:
        got = frame.dtype if isinstance(frame, np.ndarray) else type(frame).__name__
        raise MediaError(f"{what}: frames must be uint8 numpy arrays, got {got}")
    if frame.shape != (height, width, 3):
        raise MediaError(f"{what}: frame shape must be ({height}, {width}, 3) (H, W, RGB), got {frame.shape}")


def _reason(error: BaseException) -> str:
    """The human part of a PyAV/OS error (without errno noise)."""
    return getattr(error, "strerror", None) or str(error)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold Ctrl-C and a stop signal (SIGTERM, SIGHUP) back while encoded packets are written or a file is
    finalised, then deliver the first one. Raised between an encode and its mux, it would lose the packets
    just encoded, the stream's first keyframe among them: a kept file that plays nothing. A signal held here that
    is not ignored stops the open outputs (FrameSink.stop), so that a write to a network output whose receiver
    takes nothing gives up at once. It is delivered even when the block raises (a write that failed): a Ctrl-C
    is then still a Ctrl-C, with the failure as its context, not lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous: dict[int, Any] = {}

    def hold(signum: int, _frame: Any) -> None:
        received.append(signum)
        if previous.get(signum) != signal.SIG_IGN:
            for sink in list(_OPEN_SINKS):
                sink.stop()

    for signum in DEFERRED_SIGNALS:
        previous[signum] = signal.signal(signum, hold)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            _deliver(received[0], previous[received[0]])


def _deliver(signum: int, handler: Any) -> None:
    """Do with a signal held back what ``handler``, the one it would have met, does."""
    if handler is signal.default_int_handler:
        raise KeyboardInterrupt
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.raise_signal(signum)


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
