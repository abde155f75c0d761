"""What every media source and sink shares: the error they raise, the source interface, the checks and
timeout inputs and outputs both use, and the base of application outputs (NDI, Spout, Syphon, virtual camera)
with the import guard for their bindings.

The modules for each kind of input and output import this one and nothing of each other, so the
factories (``sources``, ``sinks``, ``app_io``) can import them without a cycle.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from loom_live.host_bridge.wire import pixels

PACKAGE = "loom-live"
_PLATFORM_NAMES = {"win32": "Windows", "darwin": "macOS"}
# How long opening a network input or output waits for an answer (open_source, open_sink).
DEFAULT_OPEN_TIMEOUT_S = 10.0


class MediaError(ValueError):
    """A source or sink could not be opened, read or written; the message says why."""


class FrameSource:
    """Iterable of uint8 RGB frames ``[H, W, 3]`` with the stream's rate and size.

    ``frame_count`` is exact when the file records it, estimated from the duration otherwise
    (MKV), and None for cameras and network streams (``is_live``). Use as a context
    manager or call ``close()``; iteration ends at the end of the input. ``skipped_packets``
    counts damaged packets passed over so far (the picture goes on from the next good one).
    """

    skipped_packets = 0

    def __init__(self, name: str, fps: float, width: int, height: int, frame_count: int | None,
                 is_live: bool) -> None:
        self.name = name
        self.fps = fps
        self.width = width
        self.height = height
        self.frame_count = frame_count
        self.is_live = is_live
        self.closed = False

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.width, self.height

    def read(self) -> np.ndarray | None:
        """The next frame, or None at the end of the input."""
        if self.closed:
            raise MediaError(f"{self.name}: source is closed")
        return self._read()

    def __iter__(self) -> Iterator[np.ndarray]:
        while (frame := self.read()) is not None:
            yield frame

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._close()

    def __enter__(self) -> FrameSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        count = "live" if self.frame_count is None else f"{self.frame_count} frames"
        return f"<{type(self).__name__} {self.name!r} {self.width}x{self.height} @ {self.fps:g} fps, {count}>"

    def _read(self) -> np.ndarray | None:
        raise NotImplementedError

    def _close(self) -> None:
        """Release the underlying device or file (subclasses)."""


def check_size(size: tuple[int, int], what: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in size)
    except (TypeError, ValueError):
        raise MediaError(f"{what}: size must be (width, height), got {size!r}") from None
    if width < 2 or height < 2:
        raise MediaError(f"{what}: size must be at least 2x2, got {width}x{height}")
    return width, height


def reason(error: BaseException) -> str:
    """The human part of a PyAV/OS error (without errno noise)."""
    return getattr(error, "strerror", None) or str(error)


def require(module: str, extra: str, what: str, platform: str | None = None) -> ModuleType:
    """Import ``module`` for ``what`` or raise a MediaError naming the extra that provides it.

    ``platform``: the ``sys.platform`` prefix the binding exists for (Spout: win32, Syphon: darwin);
    elsewhere the refusal says so instead of suggesting an install that cannot work.
    """
    if platform is not None and not sys.platform.startswith(platform):
        raise MediaError(f"{what} exists only on {_PLATFORM_NAMES.get(platform, platform)}; "
                         f"this is {sys.platform}")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MediaError(f"{what} needs the {module.split('.')[0]} package: pip install "
                         f"'{PACKAGE}[{extra}]' ({exc})") from None
    except OSError as exc:  # the package is there but its native runtime (a DLL, a framework) is not
        raise MediaError(f"{what}: {module} is installed but its runtime did not load: {exc}") from None


class AppSink:
    """One application output; subclasses open the binding and implement ``_send`` and ``_stop``.

    ``is_network`` is True: like a stream, what was sent is gone, nothing is kept or discarded.
    """

    is_network = True

    def __init__(self, name: str, fps: float, size: tuple[int, int]) -> None:
        self.name = name
        self.fps = fps
        self.width, self.height = size
        self.frames_written = 0
        self.closed = False

    @property
    def size(self) -> tuple[int, int]:
        return self.width, self.height

    @property
    def kept(self) -> bool:
        return self.frames_written > 0

    @property
    def written_to(self) -> str:
        """What the run's report names as this output."""
        return self.name

    def write(self, frame: np.ndarray) -> None:
        """Send one uint8 RGB frame ``[H, W, 3]`` of the sink's size."""
        if self.closed:
            raise MediaError(f"{self.name}: output is closed")
        if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or \
                frame.shape != (self.height, self.width, 3):
            got = frame.shape if isinstance(frame, np.ndarray) else type(frame).__name__
            raise MediaError(f"{self.name}: frames must be uint8 ({self.height}, {self.width}, 3) RGB, got {got}")
        try:
            self._send(frame)
        except MediaError:
            raise
        except Exception as exc:  # a binding's own error (the receiving side went away, a GPU error)
            raise MediaError(f"{self.name}: sending failed: {exc}") from exc
        self.frames_written += 1

    def stop(self) -> None:
        """A stop is on its way: nothing to cut short, as no send waits on a receiver (a FrameSink's stream does)."""

    def close(self, keep: bool = True, stopping: bool = False) -> None:
        """Stop the output (``keep`` and ``stopping`` are meaningless here: receivers already have what was sent,
        and no send waits on them)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._stop()
        except Exception as exc:
            raise MediaError(f"{self.name}: stopping the output failed: {exc}") from exc

    def discard(self) -> str:
        """Stop the output; nothing is left behind, so nothing to add to its failure line ("")."""
        try:
            self.close()
        except MediaError:
            pass
        return ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.width}x{self.height} @ {self.fps:g} fps>"

    def _send(self, frame: np.ndarray) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError


def opaque_rgba(frame: np.ndarray, out: np.ndarray | None = None, bgr: bool = False) -> np.ndarray:
    """RGB (or, with ``bgr``, BGR) plus an opaque alpha channel: what texture and NDI receivers
    composite, so that Loom's picture never shows through as transparent."""
    h, w = frame.shape[:2]
    if out is None or out.shape != (h, w, 4):
        out = np.empty((h, w, 4), np.uint8)
    return pixels.from_engine(frame, channels=4, order="BGRA" if bgr else "RGBA", out=out)


def call(obj: Any, method: str, *args: Any) -> Any:
    """``obj.method(*args)``; a binding method that returns False failed (the SDKs report so, no exception)."""
    result = getattr(obj, method)(*args)
    if result is False:
        raise RuntimeError(f"{method} failed")
    return result
