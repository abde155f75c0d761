"""The page's camera frames handed to the decoder as soon as their last packet is in, not a frame later.

aiortc's video jitter buffer knows a frame is whole only when a packet of the next frame arrives, so
every camera frame waited one camera frame period (67 ms at 15 FPS) on the host before it was even
decoded. A sender marks the last packet of each frame (the RTP marker bit, which browsers set on
video); this buffer releases a frame once its marked packet and every packet before it are in, and
otherwise (a lost marker, packets out of order) falls back to aiortc's own rule.

The buffer is swapped into each video receiver of a peer before media flows. aiortc keeps it in a
private attribute: if a later aiortc moves it, `install` logs that and leaves aiortc's own buffer,
so the page still works, one frame later.
"""

from __future__ import annotations

import logging
from typing import Any

from aiortc.jitterbuffer import JitterBuffer, JitterFrame

log = logging.getLogger(__name__)
CAPACITY = 512  # packets, as aiortc's own video buffer
_ATTRIBUTE = "_RTCRtpReceiver__jitter_buffer"


class MarkerJitterBuffer(JitterBuffer):
    """aiortc's video jitter buffer, releasing a frame at its marked last packet."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        super().__init__(capacity=capacity, is_video=True)

    def _remove_frame(self, sequence_number: int) -> JitterFrame | None:
        packets: list[Any] = []
        timestamp = None
        for count in range(self.capacity):
            packet = self._packets[(self._origin + count) % self.capacity]
            if packet is None or (timestamp is not None and packet.timestamp != timestamp):
                break  # a gap, or the oldest frame ended unmarked: aiortc's rule decides
            timestamp = packet.timestamp
            packets.append(packet)
            if packet.marker:
                self.remove(count + 1)
                return JitterFrame(data=b"".join(p._data for p in packets), timestamp=timestamp)
        return super()._remove_frame(sequence_number)


def install(pc: Any) -> int:
    """Give each video receiver of `pc` a MarkerJitterBuffer; returns how many were swapped."""
    swapped = 0
    for transceiver in pc.getTransceivers():
        receiver = transceiver.receiver
        if transceiver.kind != "video" or receiver is None:
            continue
        if not isinstance(getattr(receiver, _ATTRIBUTE, None), JitterBuffer):
            log.warning("web: this aiortc keeps its jitter buffer elsewhere; camera frames wait one frame longer")
            return swapped
        setattr(receiver, _ATTRIBUTE, MarkerJitterBuffer())
        swapped += 1
    return swapped
