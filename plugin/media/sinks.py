"""Video out for the Loom player and ``loom eval``: H.264 files, and the network streams of ``network_output``.

Every front end opens its outputs here (``open_sink``), so that a bad output always ends in a ``MediaError``
whose message names it and what is allowed, and a file is finished or left out whole: written to a partial
and moved into place (``partial_files``), finalised even when the run is interrupted (``stop_signals``).

No torch and no engine: the player runs in the host process. ``av`` (PyAV) is imported inside the functions
that need it, so importing this module costs nothing of it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from loom_live.plugin.media.audio_passthrough import AudioPassThrough, audio_file
from loom_live.plugin.media.base import DEFAULT_OPEN_TIMEOUT_S, MediaError, check_size, reason
from loom_live.plugin.media.network_output import (
    NETWORK_ENCODER_OPTIONS,
    NETWORK_SINK_FORMATS,
    NetworkSender,
    StreamCutOff,
    close_wait_s,
    stream_target,
)
from loom_live.plugin.media.partial_files import aside_path, claim_partial, move_without_replacing, partial_path
from loom_live.plugin.media.stop_signals import OPEN_SINKS, signals_deferred

log = logging.getLogger(__name__)

# The frame rates an output is written at: a file's time base holds them, and players decode them.
SINK_FPS_RANGE = (0.01, 1000.0)
FILE_SINK_SUFFIXES = (".mp4", ".mkv", ".mov")
# x264 `fast`: `veryfast` (crf 17) would cost a third less CPU beside the engine, but a file it was
# writing when Ctrl-C came was left with no decodable frame in 4 of 7 tries (test_video_io's Ctrl-C test).
FILE_ENCODER_OPTIONS = {"preset": "fast", "crf": "18"}
# The largest pictures PyAV's encoder opens (measured on PyAV 18, FFmpeg 8): libx264 takes at most 16384 px a side,
# and FFmpeg's picture check (av_image_check_size) at most (W + 128) x (H + 128) < 2^28, so 16384x16128 or
# 16254x16254. Beyond, the output failed to start with "Invalid argument", naming neither the size nor the limit.
H264_MAX_SIDE = 16384
H264_MAX_PADDED_AREA = 2**28 - 1


@atexit.register
def _close_open_sinks() -> None:
    """Finalise files a program forgot to close, so they still play."""
    for sink in list(OPEN_SINKS):
        with contextlib.suppress(Exception):
            sink.close()


class FrameSink:
    """H.264 (yuv420p) output to a file or a network stream; build it with ``open_sink``.

    The size is fixed at open. ``close()`` flushes the encoder and writes the container
    trailer; it runs even when the program is interrupted (use ``with`` or ``finally``), and a
    second Ctrl-C during ``close()`` is held back until the file is complete.

    A file is written to ``partial_path(target)`` and renamed onto the target only by a ``close()``
    that finalises it with at least one frame: a run that fails, or stops before its first frame,
    leaves whatever was at the target as it was. Without ``overwrite`` a file that appeared at the target
    during the run is never replaced either: the finished file goes beside it (``kept_at``), which its owner says
    (``written_to``: the player's last line), once.
    """

    def __init__(self, name: str, target: str, container_format: str | None, is_network: bool,
                 fps: float, width: int, height: int, audio_from: Path | None,
                 open_timeout: float = DEFAULT_OPEN_TIMEOUT_S, overwrite: bool = True,
                 while_waiting: Callable[[], None] | None = None):
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
        self._lock = None if self._partial is None else claim_partial(self._partial, name)
        self._settled = False  # the partial was moved or removed: its name may be another run's now
        self._left = ""  # the partial could not be removed: what discard() adds to the output's failure line
        try:
            self._container = av.open(str(self._partial) if self._partial else target, "w", format=container_format)
        except (av.error.FFmpegError, OSError) as e:
            self._discard_partial()
            raise MediaError(f"{name}: cannot open for writing: {reason(e)}") from e
        try:
            self._video = self._add_video_stream(fps, width, height)
            self._audio = AudioPassThrough(self._container, audio_from, Path(target).suffix.lower()) \
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
            raise MediaError(f"{name}: cannot start the output: {reason(e)}") from e
        OPEN_SINKS.add(self)
        self._sender = NetworkSender(self, while_waiting) if is_network else None

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
            raise MediaError(f"{self.name}: writing failed: {reason(e)}") from e

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
        given up on after STOP_GRACE_S rather than NETWORK_STALL_S (StreamCutOff: the stop's doing, not a failure);
        a file is finished in full all the same.
        """
        import av

        if self.closed:
            return
        self.closed = True
        OPEN_SINKS.discard(self)
        if stopping:
            self.stop()
        wait_s = close_wait_s(self.stopping)
        if self._sender is not None and not self._sender.finish(wait_s):  # its thread is stuck inside the container
            error = StreamCutOff if self.stopping else MediaError
            raise error(f"{self.name}: stopped; the receiver took nothing for {wait_s:g} s")
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
                raise MediaError(f"{self.name}: finishing the output failed: {reason(e)}; "
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
                raise MediaError(f"{self.name}: cannot move the finished file into place: {reason(e)}{left}") from e
            self._release()

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
                move_without_replacing(self._partial, target)
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
                log.warning("%s: cannot remove the unfinished file %s: %s", self.name, self._partial, reason(e))
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


def open_sink(spec: str | Path, fps: float, size: tuple[int, int],
              audio_from: str | int | Path | None = None, overwrite: bool = True, *,
              open_timeout: float = DEFAULT_OPEN_TIMEOUT_S,
              while_waiting: Callable[[], None] | None = None) -> FrameSink:
    """Open an H.264 output: a .mp4/.mkv/.mov file, or udp:// / srt:// (MPEG-TS), rtmp:// (FLV); or an
    application output (ndi://, spout://, syphon://, virtualcam: see ``plugin.media.app_io``).

    ``size`` is (width, height), both even (yuv420p). ``audio_from``: the source spec whose
    audio should go into a file output; ignored for cameras, URLs and network outputs, and when
    the source has no audio. A file output is never the ``audio_from`` file, and with
    ``overwrite=False`` never an existing file (see ``check_output_file``). An RTMP server that
    leaves the connection or a send unanswered for ``open_timeout`` seconds fails the output. Without
    ``overwrite`` a file that appears at the target during the run is not replaced either (``FrameSink.kept_at``).
    ``while_waiting``: called on the writing thread while a network output's write waits on a receiver that takes
    nothing (NetworkSender.put), so that what only that thread may do goes on meanwhile: the player reads its
    window's keys there, and a quit key stops the output (``FrameSink.stop``) as a quit from another thread does.
    """
    from loom_live.plugin.media.app_io import is_app_output, open_app_sink

    width, height = check_size(size, f"output {spec}")
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
    _check_h264_size(width, height, spec_str)
    if "://" in spec_str:
        scheme = spec_str.split("://", 1)[0].lower()
        if scheme not in NETWORK_SINK_FORMATS:
            raise MediaError(f"unsupported output URL scheme {scheme!r} in {spec_str!r}; allowed: "
                             f"{', '.join(NETWORK_SINK_FORMATS)} (or a {'/'.join(FILE_SINK_SUFFIXES)} file)")
        target, container_format = stream_target(spec_str, scheme, open_timeout)
        return FrameSink(spec_str, target, container_format, True, float(fps), width, height, None,
                         open_timeout, while_waiting=while_waiting)
    path = Path(spec).expanduser()
    if path.suffix.lower() not in FILE_SINK_SUFFIXES:
        raise MediaError(f"output file {path} must end in one of {', '.join(FILE_SINK_SUFFIXES)}")
    check_output_file(path, [audio_from] if audio_from is not None else [], overwrite)
    return FrameSink(str(path), str(path), None, False, float(fps), width, height, audio_file(audio_from),
                     overwrite=overwrite)


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


def _check_h264_size(width: int, height: int, what: str) -> None:
    """Refuse a picture larger than the encoder opens (H264_MAX_SIDE), suggesting the largest of its shape that fits:
    the size is known before the run starts (the input's, or --size), and the encoder alone would not say it."""
    if _h264_takes(width, height):
        return
    square, _ = _h264_fit(H264_MAX_SIDE, H264_MAX_SIDE)
    fit_w, fit_h = _h264_fit(width, height)
    raise MediaError(f"{what}: {width}x{height} is larger than H.264 takes (at most {H264_MAX_SIDE} px a side, and "
                     f"{square}x{square} for a square); give --size {fit_w}x{fit_h} or smaller")


def _h264_takes(width: int, height: int) -> bool:
    return max(width, height) <= H264_MAX_SIDE and (width + 128) * (height + 128) <= H264_MAX_PADDED_AREA


def _h264_fit(width: int, height: int) -> tuple[int, int]:
    """The largest even size of the picture's shape that H.264 takes."""
    longer = max(width, height)
    side = min(longer, H264_MAX_SIDE) // 2 * 2
    while True:
        w, h = (max(2, round(v * side / longer / 2) * 2) for v in (width, height))
        if _h264_takes(w, h):
            return w, h
        side -= 2


def _check_frame(frame: np.ndarray, width: int, height: int, what: str) -> None:
    if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8:
        got = frame.dtype if isinstance(frame, np.ndarray) else type(frame).__name__
        raise MediaError(f"{what}: frames must be uint8 numpy arrays, got {got}")
    if frame.shape != (height, width, 3):
        raise MediaError(f"{what}: frame shape must be ({height}, {width}, 3) (H, W, RGB), got {frame.shape}")
