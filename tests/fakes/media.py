"""Generated media for tests: small H.264 clips written with PyAV, frame stacks for sessions, a free UDP
port for stream outputs, and an RTMP server (FFmpeg's own) to stream to."""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from loom_live.plugin.media import network_output
from loom_live.plugin.media.base import MediaError
from loom_live.plugin.media.sinks import FrameSink, open_sink


def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that nobody holds right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rtmp_server(body: str) -> tuple[str, subprocess.Popen]:
    """FFmpeg's own RTMP server in a process of its own (PyAV holds the GIL while an output connects), running
    ``body`` on ``c``, the input it received; and its URL. It opens the input on the stream's first bytes, not
    megabytes of probing, with a small receive buffer: one that then reads nothing (``time.sleep``) stalls its
    sender soon (see small_send_buffers)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"rtmp://127.0.0.1:{probe.getsockname()[1]}/live/loom"
    options = {"listen": "1", "probesize": "32", "analyzeduration": "0", "recv_buffer_size": "8192"}
    script = f"import av, sys, time\nc = av.open(sys.argv[1], options={options!r}, timeout=20)\n" \
        + textwrap.dedent(body)
    return url, subprocess.Popen([sys.executable, "-c", script, url], stdout=subprocess.PIPE, text=True)


def open_when_listening(url: str, size: tuple[int, int], timeout_s: float = 20.0) -> FrameSink:
    """A FrameSink on ``url`` once its server (rtmp_server, starting in its own process) listens."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return open_sink(url, 24, size)
        except MediaError:  # not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def small_send_buffers() -> None:
    """Give the RTMP outputs opened from now on a small socket send buffer (the kernel's own grows to 4 MiB): with
    a receiver that reads nothing a sender stalls within a frame or two, and for good. One that had megabytes
    queued went on in bursts whenever a window probe freed a few bytes, long after it had looked stuck."""
    tee_output = network_output._tee_output
    network_output._tee_output = lambda url, container_format, timeout_s: \
        "[send_buffer_size=16384:" + tee_output(url, container_format, timeout_s)[1:]


def ctrl_c_once_stuck(frames: queue.Queue, pressed: list[float], read_all: Path, stuck_s: float = 1.0) -> None:
    """Press Ctrl-C (SIGINT to this process) once the output is stuck (wait_until_stuck); ``pressed`` gets when
    (time.monotonic)."""
    wait_until_stuck(frames, read_all, stuck_s)
    pressed.append(time.monotonic())
    os.kill(os.getpid(), signal.SIGINT)


def wait_until_stuck(frames: queue.Queue, read_all: Path, stuck_s: float = 1.0) -> None:
    """Return once the receiver has read all it ever will (``read_all`` exists: an rtmp_server's body makes it,
    then sleeps) and the oldest frame in ``frames``, a network output's queue, has not been taken for ``stuck_s``:
    its sending thread is stuck on the full connection (a full queue alone is not: a writer faster than the
    encoder keeps it full)."""
    while not read_all.exists():
        time.sleep(0.02)
    oldest, since = None, time.monotonic()
    while True:
        with frames.mutex:
            head = frames.queue[0] if frames.queue else None
        now = time.monotonic()
        if head is None or head is not oldest:
            oldest, since = head, now
        elif now - since >= stuck_s:
            return
        time.sleep(0.02)


def write_clip(path: Path, frames: list[np.ndarray], fps: int = 24) -> Path:
    """H.264 (yuv420p) of RGB uint8 `frames`, a keyframe every 12 frames and no B-frames (so no decoder
    delay); the container follows the suffix (.mp4, .ts, .mkv)."""
    import av

    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=fps, options={"g": "12", "bframes": "0"})
        video.height, video.width = frames[0].shape[:2]
        video.pix_fmt = "yuv420p"
        for i, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
    return path


def noise_clip(path: Path, n: int, size: tuple[int, int] = (64, 48), seed: int = 0) -> Path:
    """`n` noise frames of `size` (width, height): a file big enough to damage in the middle of its
    picture data."""
    rng = np.random.default_rng(seed)
    return write_clip(path, [rng.integers(0, 256, (size[1], size[0], 3), np.uint8) for _ in range(n)])


def damage_middle(path: Path, nbytes: int = 3000) -> Path:
    """Scramble `nbytes` in the middle of the file (inside the picture data of a noise clip): it opens,
    then packets fail to decode mid-stream, like a copy cut short or a bad sector."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + nbytes] = bytes((b * 7 + 13) & 255 for b in data[mid:mid + nbytes])
    path.write_bytes(bytes(data))
    return path


def panning_clip(n: int, h: int = 64, w: int = 64, seed: int = 0, shift: int = 1) -> np.ndarray:
    """[n, h, w, 3] uint8: one random image moving `shift` pixels right per frame (motion a stream
    model sees, content a test can predict)."""
    base = np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)
    return np.stack([np.roll(base, shift * i, axis=1) for i in range(n)])


def write_y4m(path: Path, frames: list[np.ndarray], fps: int = 24) -> Path:
    """YUV4MPEG2 (4:2:0) of RGB uint8 `frames`: what Chromium's fake camera plays
    (`--use-file-for-fake-video-capture`), in a loop."""
    import cv2

    h, w = frames[0].shape[:2]
    with open(path, "wb") as f:
        f.write(f"YUV4MPEG2 W{w} H{h} F{fps}:1 Ip A1:1 C420jpeg\n".encode())
        for image in frames:
            f.write(b"FRAME\n")
            f.write(cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2YUV_I420).tobytes())
    return path
