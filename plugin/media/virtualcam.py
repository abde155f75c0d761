"""A virtual camera through pyvirtualcam: OBS's virtual camera (Windows, macOS) or v4l2loopback (Linux),
so video-call and streaming apps can pick Loom as a webcam."""

from __future__ import annotations

import sys

import numpy as np

from loom_live.plugin.media.base import AppSink, MediaError, require

# What makes a virtual camera exist, per platform: pyvirtualcam only drives one that is installed.
_BACKEND_HINTS = {
    "linux": "load v4l2loopback (sudo modprobe v4l2loopback devices=1 exclusive_caps=1)",
    "win32": "install OBS Studio 26+ and start its virtual camera once",
    "darwin": "install OBS Studio 30+ and start its virtual camera once (it installs the camera extension)",
}


class VirtualCamSink(AppSink):
    """Frames to the system's virtual camera (``device``: a /dev/videoN on Linux, else the default)."""

    def __init__(self, fps: float, size: tuple[int, int], device: str | None = None) -> None:
        super().__init__("virtualcam" + (f"://{device}" if device else ""), fps, size)
        pyvirtualcam = require("pyvirtualcam", "virtualcam", "the virtual camera")
        try:
            self._camera = pyvirtualcam.Camera(self.width, self.height, fps, fmt=pyvirtualcam.PixelFormat.RGB,
                                               device=device)
        except Exception as exc:  # RuntimeError listing every backend's reason, ValueError for a bad size
            why = " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            hint = next((h for p, h in _BACKEND_HINTS.items() if sys.platform.startswith(p)), "")
            raise MediaError(f"{self.name}: no virtual camera could be opened ({why})"
                             + (f"; {hint}" if hint else "")) from None
        self.name = f"virtualcam ({self._camera.device})"

    def _send(self, frame: np.ndarray) -> None:
        self._camera.send(frame)

    def _stop(self) -> None:
        self._camera.close()
