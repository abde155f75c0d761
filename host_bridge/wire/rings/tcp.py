"""Frames over the ZMQ connection itself, for an engine on another machine.

There is no shared memory: a frame travels as the payload part of its `frame` notice, raw
(the slot's bytes) or JPEG-compressed through OpenCV. The slots remain as credits: the writer
has at most `slots` frames in flight and reuses a slot index only after the reader released it,
so a slow link or engine never builds a queue, exactly as with the shared rings.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loom_live.host_bridge.wire import pixels
from loom_live.host_bridge.wire.protocol import ProtocolError, RingSpec
from loom_live.host_bridge.wire.rings.base import Ring


class TcpRing(Ring):
    def __init__(self, spec: RingSpec):
        self.spec = spec
        if spec.encoding == "jpeg":
            import cv2  # noqa: F401  (fail at ring creation, not at the first frame)

    def write(self, slot: int, frame: np.ndarray) -> list[Any]:
        self.check_slot(slot)
        self.check_frame(frame)
        if self.spec.encoding == "jpeg":
            import cv2
            bgr = pixels.from_engine(frame, order="BGR")  # OpenCV's channel order
            ok, data = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, self.spec.jpeg_quality])
            if not ok:
                raise RuntimeError("JPEG encoding failed")
            return [data.tobytes()]
        return [np.ascontiguousarray(frame).tobytes()]

    def read(self, slot: int, payload: list[bytes]) -> np.ndarray:
        self.check_slot(slot)
        if len(payload) != 1:
            raise ProtocolError("tcp frame: expected one payload part")
        data = payload[0]
        if self.spec.encoding == "jpeg":
            import cv2
            decoded = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
            if decoded is None or decoded.shape != self.shape:
                raise ProtocolError(f"tcp frame: JPEG payload does not decode to {self.shape}")
            return pixels.to_engine(decoded, order="BGR")
        expected = self.spec.height * self.spec.row_bytes
        if len(data) != expected:
            raise ProtocolError(f"tcp frame: payload has {len(data)} bytes; the ring's frames have {expected}")
        return np.frombuffer(data, self.spec.dtype).reshape(self.shape).copy()

    def close(self) -> None:
        pass
