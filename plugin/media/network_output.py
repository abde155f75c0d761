"""Network outputs (udp://, srt://, rtmp://): what FFmpeg opens for them, and the thread that sends to them.

A receiver that stops taking data (a network gone, a stuck server) must stall its output for a few seconds at
most, never the show: frames go to a thread of its own (``NetworkSender``), a write that waits on a receiver
that takes nothing gives up, and a stop (Ctrl-C, quit) waits on it for a moment only.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlsplit

import numpy as np

from loom_live.plugin.media.base import MediaError, reason

NETWORK_SINK_FORMATS = {"udp": "mpegts", "srt": "mpegts", "rtmp": "flv", "rtmps": "flv"}
PORTED_SINK_SCHEMES = ("udp", "srt")  # outputs with no default port (RTMP's is 1935)
# 7 MPEG-TS packets of 188 bytes: the UDP datagram size VLC, OBS and TouchDesigner expect.
UDP_TS_PACKET_SIZE = 1316
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


class StreamedSink(Protocol):
    """What a NetworkSender uses of its FrameSink: its name, its stop flag (FrameSink.stop) and its encoder."""

    name: str
    stopping: bool

    def _encode(self, frame: np.ndarray, pts: int) -> None: ...


class NetworkSender:
    """Encodes and sends a network output's frames on a thread of its own, so that a receiver that stops taking
    them stalls that output for at most NETWORK_STALL_S, not the show until TCP gives up."""

    def __init__(self, sink: StreamedSink, while_waiting: Callable[[], None] | None = None) -> None:
        self._sink = sink
        self._while_waiting = while_waiting
        self._queue: queue.Queue[np.ndarray | None] = queue.Queue(NETWORK_QUEUE_FRAMES)
        self._error: str | None = None
        self._stalled = False
        self._thread = threading.Thread(target=self._run, name=f"loom output {sink.name}", daemon=True)
        self._thread.start()

    def put(self, frame: np.ndarray) -> bool:
        """Queue one frame; a failed send, or a receiver that took nothing for NETWORK_STALL_S, is a MediaError.

        False: the frame was dropped, as a stop came (FrameSink.stop) while the receiver took nothing; the stop
        then ends the output (finish) without the wait. While it waits, ``while_waiting`` (see open_sink) is called
        every STOP_POLL_S on this thread, before the stop flag is looked at: a stop it makes cuts this wait short."""
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
            if self._while_waiting is not None:
                self._while_waiting()
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
                self._error = reason(e)
                return
            pts += 1


class StreamCutOff(MediaError):
    """A stop (Ctrl-C, a stop signal, a quit) gave up on a network output whose receiver took nothing: its last
    frames are lost because the user stopped the run, so this is no failed output (a receiver that takes nothing
    when the run ends by itself is: a plain MediaError)."""


def close_wait_s(stopping: bool) -> float:
    """How long closing a network output waits for its receiver: STOP_GRACE_S once a stop is on its way, else
    NETWORK_STALL_S."""
    return STOP_GRACE_S if stopping else NETWORK_STALL_S


def stream_target(spec: str, scheme: str, open_timeout: float) -> tuple[str, str]:
    """What FFmpeg opens for the network output ``spec`` (of ``scheme``, one of NETWORK_SINK_FORMATS), and in
    which container format; an RTMP server that leaves a wait unanswered for ``open_timeout`` s fails it."""
    _check_port(spec, scheme)
    target, container_format = spec, NETWORK_SINK_FORMATS[scheme]
    if scheme == "udp" and "?" not in target:
        target += f"?pkt_size={UDP_TS_PACKET_SIZE}"
    if scheme in TEE_SINK_SCHEMES:
        target, container_format = _tee_output(target, container_format, open_timeout), "tee"
    return target, container_format


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
