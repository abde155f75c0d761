"""GPU texture sharing with VJ software: Spout (Windows, SpoutGL) and Syphon (macOS, syphon-python).

Both share RGBA textures; receivers (Resolume, TouchDesigner, OBS, MadMapper) composite with the
alpha, so it is sent opaque. Frames arrive from the engine on the CPU and are uploaded once per
frame by the binding.
"""

from __future__ import annotations

import numpy as np

from loom_live.plugin.media.base import AppSink, call, opaque_rgba, require

# OpenGL's GL_RGBA enum, the pixel format SpoutGL's sendImage is given (no PyOpenGL needed for one constant).
GL_RGBA = 0x1908


class SpoutSink(AppSink):
    """A Spout sender named ``name``; receivers see frames when ``setFrameSync`` signals them."""

    def __init__(self, name: str, fps: float, size: tuple[int, int]) -> None:
        super().__init__(f"spout://{name}", fps, size)
        spout = require("SpoutGL", "spout", "Spout output", platform="win32")
        self._sender_name = name
        self._sender = spout.SpoutSender()
        self._sender.setSenderName(name)
        self._rgba: np.ndarray | None = None

    def _send(self, frame: np.ndarray) -> None:
        self._rgba = opaque_rgba(frame, self._rgba)
        # top row first, as Spout's receivers expect (invert=False); 0: no host framebuffer
        call(self._sender, "sendImage", self._rgba, self.width, self.height, GL_RGBA, False, 0)
        self._sender.setFrameSync(self._sender_name)

    def _stop(self) -> None:
        self._sender.releaseSender()


class SyphonSink(AppSink):
    """A Syphon Metal server named ``name``, publishing one RGBA texture per frame."""

    def __init__(self, name: str, fps: float, size: tuple[int, int]) -> None:
        super().__init__(f"syphon://{name}", fps, size)
        syphon = require("syphon", "syphon", "Syphon output", platform="darwin")
        to_texture = require("syphon.utils.numpy", "syphon", "Syphon output")
        raw = require("syphon.utils.raw", "syphon", "Syphon output")
        self._copy = to_texture.copy_image_to_mtl_texture
        self._server = syphon.SyphonMetalServer(name)
        self._texture = raw.create_mtl_texture(self._server.device, self.width, self.height)
        self._rgba: np.ndarray | None = None

    def _send(self, frame: np.ndarray) -> None:
        self._rgba = opaque_rgba(frame, self._rgba)
        self._copy(self._rgba, self._texture)
        self._server.publish_frame_texture(self._texture)

    def _stop(self) -> None:
        self._server.stop()
