"""Training data for the embedded model: styled clip pairs, prepared on the CPU, in one file.

Sources (all at the model's resolution, centre-cropped square):
- the shared test clips except the held-out ones (`HELD_OUT`, kept for evaluation) and except
  any DAVIS sequence not already in ../shared/media (those stay for independent evaluation);
- generated clips: Loom's own moving-shapes clip (two seeds), and slow synthetic camera moves
  (pan and zoom) over frames of the training clips, for motion the short clips lack.

Every clip's source is stored as an H.264 4:4:4 stream (crf 16, about 35 dB PSNR; 2-3x smaller
than JPEG at the same quality), so the whole set is one small file that travels to the GPU machine.
The styles are not stored: `load_pairs` decodes the sources and draws every style from the decoded
frames, on all cores. A stored styled stream would carry the codec's own error, and on dark styles
that error is large where it matters (a near-black pixel moved by a level or two takes a loud hue):
drawn at load, each target is exactly the style of the frames the model sees.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from loom_live.engine.train.styles import STYLE_NAMES, apply_style
from loom_live.host_bridge.wire.files import write_replacing

HELD_OUT = ("davis512_parkour.mp4", "davis512_libby.mp4")
TRAIN_CLIPS = ("davis512_blackswan.mp4", "davis512_kite-surf.mp4", "davis512_scenecut_kite_dance.mp4",
               "sdv2_original_832x480.mp4")
# The project's shared clips beside the checkout, or $LOOM_MEDIA (a checkout elsewhere, as the tests take it)
MEDIA = Path(os.environ.get("LOOM_MEDIA") or Path(__file__).resolve().parents[2].parent / "shared" / "media")
SOURCE = "source"
CRF = 16
GENERATED_FRAMES = 49
CAMERA_FRAMES = (0, 40)  # the frames of each training clip that the camera moves look at


@dataclass
class Clip:
    name: str
    frames: dict[str, np.ndarray]  # "source" and each style name -> [T, H, W, 3] uint8 RGB


def square(frame: np.ndarray, size: int) -> np.ndarray:
    """Centre-crop to a square and resize (what the engine's `crop` resize policy does)."""
    h, w = frame.shape[:2]
    s = min(h, w)
    top, left = (h - s) // 2, (w - s) // 2
    return cv2.resize(frame[top:top + s, left:left + s], (size, size), interpolation=cv2.INTER_AREA)


def read_clip(path: str | Path, size: int, limit: int | None = None) -> np.ndarray:
    """Frames of a video file as [T, size, size, 3] uint8 RGB."""
    if not Path(path).is_file():
        # the recipe's clips are the project's shared test media, which a fresh clone lacks
        raise FileNotFoundError(f"{path}: no such file; the recipe reads its clips from {MEDIA} "
                                "(../shared/media beside the checkout), or from the folder $LOOM_MEDIA names")
    cap = cv2.VideoCapture(str(path))
    frames = []
    while limit is None or len(frames) < limit:
        ok, bgr = cap.read()
        if not ok:
            break
        frames.append(square(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), size))
    cap.release()
    if not frames:
        raise ValueError(f"{path}: no frames could be read")
    return np.stack(frames)


def shapes_clip(seed: int, size: int, n: int = GENERATED_FRAMES) -> np.ndarray:
    """Loom's built-in generated clip (plugin.media.generated_clip.generate_clip: moving textured squares
    and shaded discs over a drifting gradient), the same frames to within one grey
    level, computed here because the engine never imports the host side."""
    rng = np.random.default_rng(seed)
    pos = rng.uniform(0.1, 0.9, (6, 2)) * (size, size)
    vel = rng.uniform(1.5, 5.0, (6, 2)) * rng.choice([-1.0, 1.0], (6, 2))
    radius = rng.uniform(0.06, 0.14, 6) * size
    colour = rng.uniform(30, 255, (6, 3))
    square = rng.random(6) < 0.5
    phase = rng.uniform(0, 2 * np.pi, 3)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    u, v = x / size, y / size
    frames = []
    for t in range(n):
        img = np.stack([90 + 60 * np.sin(2 * np.pi * (u * (c + 1) * 0.5 + v * 0.7 + 0.01 * t) + phase[c])
                        for c in range(3)], axis=-1)
        for p, vl, r, col, sq in zip(pos, vel, radius, colour, square):
            dx, dy = x - _bounce(p[0] + vl[0] * t, r, size - r), y - _bounce(p[1] + vl[1] * t, r, size - r)
            if sq:
                mask = (np.abs(dx) < r) & (np.abs(dy) < r)
                fill = col * (0.55 + 0.45 * ((np.floor(dx / (r / 3)) + np.floor(dy / (r / 3))) % 2)[..., None])
            else:
                mask = dx * dx + dy * dy < r * r
                fill = col * (1.0 - 0.4 * np.sqrt(dx * dx + dy * dy)[..., None] / r)
            img = np.where(mask[..., None], fill, img)
        frames.append(np.clip(img, 0, 255).astype(np.uint8))
    return np.stack(frames)


def _bounce(p: float, lo: float, hi: float) -> float:
    span = hi - lo
    q = (p - lo) % (2 * span)
    return lo + (q if q < span else 2 * span - q)


def camera_move(still: np.ndarray, size: int, seed: int, n: int = GENERATED_FRAMES) -> np.ndarray:
    """A slow pan plus zoom over one still frame: rigid motion with known, smooth flow."""
    rng = np.random.default_rng(seed)
    h, w = still.shape[:2]
    s0, s1 = rng.uniform(0.55, 0.8) * min(h, w), rng.uniform(0.55, 0.8) * min(h, w)
    x0, y0 = rng.uniform(0, w - s0), rng.uniform(0, h - s0)
    x1, y1 = rng.uniform(0, w - s1), rng.uniform(0, h - s1)
    out = []
    for t in np.linspace(0.0, 1.0, n):
        s, x, y = s0 + (s1 - s0) * t, x0 + (x1 - x0) * t, y0 + (y1 - y0) * t
        m = np.array([[size / s, 0, -x * size / s], [0, size / s, -y * size / s]], np.float32)
        out.append(cv2.warpAffine(still, m, (size, size), flags=cv2.INTER_AREA, borderMode=cv2.BORDER_REFLECT))
    return np.stack(out)


def source_clips(media: Path, size: int) -> dict[str, np.ndarray]:
    clips = {Path(n).stem: read_clip(media / n, size) for n in TRAIN_CLIPS}
    for seed in (1, 2):
        clips[f"shapes_{seed}"] = shapes_clip(seed, size)
    for seed, (name, at) in enumerate((n, at) for at in CAMERA_FRAMES for n in TRAIN_CLIPS):
        still = read_clip(media / name, 512, limit=at + 1)[at]
        clips[f"camera_{seed}"] = camera_move(still, size, seed)
    return clips


def encode_video(frames: np.ndarray, crf: int = CRF) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=24)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv444p"
        stream.options = {"crf": str(crf), "preset": "medium"}
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def decode_video(data: bytes) -> np.ndarray:
    """H.264 bytes -> [T, H, W, 3] uint8 RGB (OpenCV's FFmpeg: present wherever Loom runs)."""
    fd, name = tempfile.mkstemp(suffix=".mp4")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        cap = cv2.VideoCapture(name)
        frames = []
        while True:
            ok, bgr = cap.read()
            if not ok:
                break
            frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
        cap.release()
    finally:
        os.unlink(name)
    if not frames:
        raise ValueError("a clip's stream holds no frames that decode")
    return np.stack(frames)


def prepare(out: str | Path, size: int = 256, media: Path = MEDIA, progress: bool = True,
            held_out: bool = False) -> Path:
    """Gather every training clip (or, with `held_out`, the first 49 frames of each held-out clip:
    evaluation only) and write their sources to one .npz (H.264 streams + metadata)."""
    from tqdm import tqdm

    if held_out:
        clips = {Path(n).stem: read_clip(media / n, size, limit=GENERATED_FRAMES) for n in HELD_OUT}
    else:
        clips = source_clips(media, size)
    arrays: dict[str, np.ndarray] = {}
    for clip in tqdm(clips, desc="encoding clips", disable=not progress):
        arrays[f"{clip}/{SOURCE}"] = np.frombuffer(encode_video(clips[clip]), np.uint8)
    meta = {"size": size, "clips": list(clips), "variants": [SOURCE], "held_out": list(HELD_OUT),
            "frames": {c: len(f) for c, f in clips.items()}, "crf": CRF}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    out = Path(out)
    if out.suffix != ".npz":  # numpy adds it: the path said and given to `fit --data` is the file written
        out = out.with_name(out.name + ".npz")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_replacing(out, lambda f: np.savez(f, **arrays))
    return out


def styled(frames: np.ndarray) -> list[np.ndarray]:
    """Every style of one clip, in `STYLE_NAMES` order."""
    return [apply_style(name, frames) for name in STYLE_NAMES]


def load_pairs(path: str | Path, workers: int | None = None) -> tuple[dict, list[Clip]]:
    """Decode the data file's sources and draw every style from them, one clip per process on
    `workers` processes (default: all cores): (metadata, clips with their source and styled frames).
    The processes are spawned, not forked: the caller may already hold a GPU context."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file (`loom train prepare` makes it)")
    try:
        with np.load(path) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            sources = [decode_video(bytes(data[f"{name}/{SOURCE}"])) for name in meta["clips"]]
    except (KeyError, TypeError, ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        # another .npz (the style table), a truncated copy, a file of another version
        raise ValueError(f"{path}: not a data file of `loom train prepare` ({exc})") from None
    n = min(len(sources), workers or os.cpu_count() or 1)
    with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn")) as pool:
        styles = list(pool.map(styled, sources))
    clips = [Clip(name, {SOURCE: src, **dict(zip(STYLE_NAMES, out))})
             for name, src, out in zip(meta["clips"], sources, styles)]
    return meta, clips
