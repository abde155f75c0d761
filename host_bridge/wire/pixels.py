"""Frame format conversion between the hosts and the engine (numpy, CPU side).

Three conventions meet here:
- the engine: uint8 RGB, rows top-down, shape [H, W, 3];
- TouchDesigner: rows bottom-up (OpenGL), uint8 4-channel textures in BGRA order, every other
  dtype (uint16, float32) and channel count in RGBA order; float values nominally 0..1;
- ComfyUI `IMAGE`: float32 RGB in 0..1, rows top-down, shape [B, H, W, 3].
Each conversion is one function so the rules live in one place; the GPU variant for the CUDA
transport (engine side, torch) follows the same rules.
"""

from __future__ import annotations

import numpy as np

LAYOUTS = ("rgb", "touchdesigner")
DTYPES = (np.uint8, np.uint16, np.float32)
DTYPE_NAMES = ("uint8", "uint16", "float32")
UINT16_MAX = 65535
UINT8_MAX = 255
# OpenCV's conversions by (channels, BGR first): a host's layout to the engine's RGB, and back
TO_ENGINE_CODES = {(4, False): "COLOR_RGBA2RGB", (4, True): "COLOR_BGRA2RGB", (3, True): "COLOR_BGR2RGB"}
FROM_ENGINE_CODES = {(4, False): "COLOR_RGB2RGBA", (4, True): "COLOR_RGB2BGRA", (3, True): "COLOR_RGB2BGR"}


def check_frame(frame: np.ndarray, what: str = "frame") -> np.ndarray:
    """A host frame as [H, W, C] (C in 1..4) of a supported dtype with finite values, or a ValueError
    saying what is allowed."""
    frame = check_shape(frame, what)
    if frame.dtype.kind != "f":
        return frame
    # one pass: NaN and inf carry through a sum; only a sum past float's range (huge finite values) asks min and max
    with np.errstate(over="ignore", invalid="ignore"):
        finite = np.isfinite(frame.sum()) or (np.isfinite(frame.min()) and np.isfinite(frame.max()))
    if not finite:
        raise ValueError(f"{what}: holds NaN or infinite values; expected finite values (0..1)")
    return frame


def check_shape(frame: np.ndarray, what: str = "frame") -> np.ndarray:
    """`check_frame` without reading the values: shape and dtype only, whatever the frame's size."""
    if not isinstance(frame, np.ndarray):
        raise TypeError(f"{what}: expected a numpy array, got {type(frame).__name__}")
    if frame.ndim == 2:
        frame = frame[:, :, None]
    if frame.ndim != 3 or frame.shape[2] not in (1, 2, 3, 4) or frame.shape[0] < 1 or frame.shape[1] < 1:
        raise ValueError(f"{what}: shape {frame.shape} is not allowed; expected [H, W] or [H, W, C] with C in 1..4")
    if frame.dtype not in DTYPES:
        swapped = frame.dtype.newbyteorder() in DTYPES  # e.g. >u2 from a file format stored big-endian
        order = " in this machine's byte order (this one is byte-swapped: .astype(its dtype.newbyteorder('=')))" \
            if swapped else ""
        raise ValueError(f"{what}: dtype {frame.dtype} is not allowed; expected uint8, uint16 or float32{order}")
    return frame


def limit_size(frame: np.ndarray, max_side: int) -> np.ndarray:
    """`frame` [H, W, C] itself when neither side exceeds `max_side`, else shrunk by the smallest whole
    factor k that fits, each output pixel the mean of its k x k block (an area filter, in the frame's
    dtype). With OpenCV only every (k // 2)-th pixel of each row and column is read, and the area filter
    averages those: a large factor costs a fraction of one pass over the frame."""
    h, w = frame.shape[:2]
    k = -(-max(h, w) // max_side)
    if k <= 1:
        return frame
    oh, ow = h // k, w // k
    if oh < 1 or ow < 1:
        raise ValueError(f"frame: {w}x{h} cannot be shrunk to at most {max_side} px per side; the aspect is too "
                         "extreme")
    cv2 = _opencv()
    if cv2 is None or frame.shape[2] > 4:  # without OpenCV: numpy, every pixel
        blocks = frame[:oh * k, :ow * k].reshape(oh, k, ow, k, frame.shape[2])
        mean = blocks.mean(axis=(1, 3), dtype=np.float32)
        return mean.astype(frame.dtype) if frame.dtype.kind == "f" else np.rint(mean).astype(frame.dtype)
    step = max(1, k // 2)
    view = frame[:oh * k:step, :ow * k:step]
    return cv2.resize(view, (ow, oh), interpolation=cv2.INTER_AREA).reshape(oh, ow, frame.shape[2])


def resize(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """`frame` [H, W, C] at `height` x `width`, in its dtype (OpenCV's area filter to shrink, linear to grow;
    nearest pixels without OpenCV)."""
    h, w, c = frame.shape
    cv2 = _opencv()
    if cv2 is None or c > 4:
        rows = np.arange(height) * h // height
        cols = np.arange(width) * w // width
        return np.ascontiguousarray(frame[rows][:, cols])
    shrink = height * width <= h * w
    out = cv2.resize(frame, (width, height), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
    return out.reshape(height, width, c)


def to_uint8(values: np.ndarray) -> np.ndarray:
    """Any supported dtype to uint8 with rounding (float: 0..1 clipped; uint16: full range)."""
    if values.dtype == np.uint8:
        return values
    if values.dtype == np.uint16:
        return ((values.astype(np.uint32) * UINT8_MAX + UINT16_MAX // 2) // UINT16_MAX).astype(np.uint8)
    scaled = np.clip(values, 0.0, 1.0)  # negatives to 0 first: OpenCV's conversion below takes magnitudes
    cv2 = _opencv()
    if cv2 is not None and scaled.size:  # scales, rounds half to even (as np.rint) and saturates in one pass
        return cv2.convertScaleAbs(scaled.reshape(1, -1), alpha=UINT8_MAX).reshape(values.shape)
    scaled *= UINT8_MAX  # in place: a 1080p frame is 6M values
    return np.rint(scaled, out=scaled).astype(np.uint8)


def from_uint8(values: np.ndarray, dtype: np.dtype | type) -> np.ndarray:
    """uint8 to uint8/uint16/float32 (exact inverse of `to_uint8` on uint8-representable values)."""
    dtype = np.dtype(dtype)
    if dtype == np.uint8:
        return values
    if dtype == np.uint16:
        return values.astype(np.uint16) * np.uint16(257)
    if dtype == np.float32:
        return values.astype(np.float32) / np.float32(UINT8_MAX)
    raise ValueError(f"dtype {dtype} is not allowed; expected uint8, uint16 or float32")


def to_engine(frame: np.ndarray, *, order: str = "RGB", bottom_up: bool = False, what: str = "frame") -> np.ndarray:
    """A host frame to the engine's uint8 RGB top-down [H, W, 3] (always a new contiguous array).

    The channels are picked (and swapped) before the dtype's conversion, so alpha is never converted, and by
    OpenCV where the Python has it: numpy copies 3 bytes of every 4 one at a time, which at 1080p costs a
    host's frame loop more than a frame's time (docs/performance.md). `what` names the frame in errors."""
    frame = check_frame(frame, what)
    c = frame.shape[2]
    swap = order.upper().startswith("BGR")
    code = TO_ENGINE_CODES.get((c, swap))
    cv2 = _opencv()
    if c in (1, 2):  # grey (+alpha)
        rgb = np.repeat(frame[:, :, :1], 3, axis=2)
    elif code is not None and cv2 is not None:
        rgb = cv2.cvtColor(np.ascontiguousarray(frame), getattr(cv2, code))
    else:
        rgb = frame[:, :, 2::-1] if swap else frame[:, :, :3]
    rgb = to_uint8(rgb)
    if bottom_up:
        return cv2.flip(np.ascontiguousarray(rgb), 0) if cv2 is not None else np.ascontiguousarray(rgb[::-1])
    if np.may_share_memory(rgb, frame):  # nothing converted: copy, the caller may reuse its buffer
        return np.array(rgb, dtype=np.uint8, order="C")
    return np.ascontiguousarray(rgb)


def from_engine(rgb: np.ndarray, *, channels: int = 3, dtype: np.dtype | type | str = np.uint8, order: str = "RGB",
                bottom_up: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """The engine's uint8 RGB top-down [H, W, 3] in a host's layout, contiguous (`rgb` itself where it is in that
    layout already): `channels` 1 (the red channel), 3 or 4 (alpha opaque), in `order` (RGB or BGR first), rows
    bottom-up or not, in `dtype`. `out`: a contiguous array of that shape and dtype to write into (a sink's buffer
    kept from frame to frame), returned."""
    rgb = _engine_frame(rgb)
    if channels not in (1, 3, 4):
        raise ValueError(f"channels: {channels} is not allowed; expected 1, 3 or 4")
    swap = order.upper().startswith("BGR")
    code = FROM_ENGINE_CODES.get((channels, swap))
    cv2 = _opencv()
    if channels == 1:
        data = rgb[:, :, :1]
    elif code is not None and cv2 is not None:
        direct = out is not None and not bottom_up and np.dtype(dtype) == np.uint8  # straight into `out`
        data = cv2.cvtColor(np.ascontiguousarray(rgb), getattr(cv2, code), dst=out if direct else None)  # alpha 255
    else:
        data = rgb[:, :, ::-1] if swap else rgb
        if channels == 4:
            data = np.concatenate([data, np.full(rgb.shape[:2] + (1,), UINT8_MAX, np.uint8)], axis=2)
    if bottom_up:
        data = cv2.flip(np.ascontiguousarray(data), 0).reshape(data.shape) if cv2 is not None else data[::-1]
    result = np.ascontiguousarray(from_uint8(np.ascontiguousarray(data), dtype))
    if out is None or result is out:
        return result
    np.copyto(out, result)
    return out


def touchdesigner_order(dtype: np.dtype | type, channels: int) -> str:
    """TouchDesigner's channel order: BGRA for uint8 4-channel textures, RGBA otherwise, named for the
    channels there are (R for a mono texture, RGB for 3: a ring's order names exactly its channels)."""
    return "BGRA" if np.dtype(dtype) == np.uint8 and channels == 4 else "RGBA"[:channels]


def from_touchdesigner(frame: np.ndarray, what: str = "TouchDesigner frame") -> np.ndarray:
    """A TouchDesigner TOP array (`numpyArray()`, bottom-up) to the engine's uint8 RGB top-down; `what` names it in
    errors."""
    frame = check_shape(frame, what)  # its values are checked once, in to_engine
    return to_engine(frame, order=touchdesigner_order(frame.dtype, frame.shape[2]), bottom_up=True, what=what)


def to_touchdesigner(rgb: np.ndarray, dtype: np.dtype | type = np.uint8, channels: int = 4) -> np.ndarray:
    """Engine uint8 RGB top-down to a TouchDesigner array (`copyNumpyArray`): bottom-up, TD's channel order."""
    if channels not in (1, 3, 4):
        raise ValueError(f"channels: {channels} is not allowed; expected 1, 3 or 4")
    return from_engine(rgb, channels=channels, dtype=dtype, order=touchdesigner_order(dtype, channels), bottom_up=True)


def _engine_frame(rgb: np.ndarray) -> np.ndarray:
    if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        got = f"{rgb.dtype} {rgb.shape}" if isinstance(rgb, np.ndarray) else type(rgb).__name__
        raise ValueError(f"engine frame: {got}; expected uint8 [H, W, 3]")
    return rgb


def _opencv():
    """OpenCV where this Python has it, else None: a host's own Python (TouchDesigner's) may lack it, and every
    conversion here has a numpy form."""
    try:
        import cv2
    except ImportError:
        return None
    return cv2
