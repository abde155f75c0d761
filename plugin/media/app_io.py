"""Outputs to other video applications (NDI, Spout, Syphon, a virtual camera) through optional bindings.

A plain install has none of the bindings; asking for ``-o spout://NAME`` without SpoutGL must say
in one line what to install, not show an ImportError traceback. The player drives these sinks like
its network streams: ``write`` one RGB frame, ``close``/``discard`` at the end; nothing is kept on
disk, so there is nothing to finalise or roll back.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

import numpy as np

from plugin.media.video_io import MediaError

PACKAGE = "loom-live"
VIRTUALCAM = "virtualcam"
# Output URL schemes of this module; `virtualcam` alone (the system's default virtual camera) too.
APP_OUTPUT_SCHEMES = ("ndi", "spout", "syphon", VIRTUALCAM)
_PLATFORM_NAMES = {"win32": "Windows", "darwin": "macOS"}


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


def is_app_output(spec: str) -> bool:
    """Whether ``spec`` names an application output (ndi://, spout://, syphon://, virtualcam)."""
    return spec == VIRTUALCAM or ("://" in spec and spec.split("://", 1)[0].lower() in APP_OUTPUT_SCHEMES)


def target_name(spec: str) -> str:
    """The NAME of ``scheme://NAME``: the name receivers see; an empty one is refused."""
    scheme, _, name = spec.partition("://")
    if not name.strip():
        raise MediaError(f"output {spec!r}: give a name after {scheme}://, e.g. {scheme}://Loom")
    return name.strip()


def open_app_sink(spec: str, fps: float, size: tuple[int, int]) -> AppSink:
    """Open the application output ``spec`` (see ``is_app_output``) for frames of ``size`` at ``fps``."""
    scheme = VIRTUALCAM if spec == VIRTUALCAM else spec.split("://", 1)[0].lower()
    if scheme == "ndi":
        from plugin.media.ndi import NdiSink

        return NdiSink(target_name(spec), fps, size)
    if scheme in ("spout", "syphon"):
        from plugin.media.gpu_share import SpoutSink, SyphonSink

        return (SpoutSink if scheme == "spout" else SyphonSink)(target_name(spec), fps, size)
    from plugin.media.virtualcam import VirtualCamSink

    device = spec.split("://", 1)[1] if "://" in spec else None
    return VirtualCamSink(fps, size, device or None)


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

    def close(self, keep: bool = True) -> None:
        """Stop the output (``keep`` is meaningless here: receivers already have what was sent)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._stop()
        except Exception as exc:
            raise MediaError(f"{self.name}: stopping the output failed: {exc}") from exc

    def discard(self) -> None:
        try:
            self.close()
        except MediaError:
            pass

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
        out[..., 3] = 255
    out[..., :3] = frame[..., ::-1] if bgr else frame
    return out


def call(obj: Any, method: str, *args: Any) -> Any:
    """``obj.method(*args)``; a binding method that returns False failed (the SDKs report so, no exception)."""
    result = getattr(obj, method)(*args)
    if result is False:
        raise RuntimeError(f"{method} failed")
    return result
