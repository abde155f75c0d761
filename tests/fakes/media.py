"""Generated media for tests: small H.264 clips written with PyAV, frame stacks for sessions, and a
free UDP port for stream outputs."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np


def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that nobody holds right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
