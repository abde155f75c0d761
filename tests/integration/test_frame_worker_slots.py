"""Over tcp the engine's input slots are the host's credits: a frame the engine cannot read (a payload that
does not fit the ring, a JPEG that does not decode) is dropped and counted, and its slot is handed back as
dropped, so the stream goes on. Kept, a few such frames would leave the host no slot to send in."""

from __future__ import annotations

import numpy as np

from loom_live.engine.server.frame_worker import FrameWorker
from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.host_bridge.wire.protocol import RingSpec
from loom_live.host_bridge.wire.rings.tcp import TcpRing


class _Lane:
    def __init__(self) -> None:
        self.releases: list[tuple[int, int, bool]] = []
        self.frames: list[int] = []

    def send_release(self, slot, gen, dropped=False):
        self.releases.append((slot, gen, dropped))
        return True

    def send_frame(self, slot, seq, gen, payload=(), control=False):
        self.frames.append(seq)
        return True


def test_unreadable_tcp_frames_are_dropped_counted_and_give_their_slots_back():
    spec = dict(transport="tcp", slots=2, width=4, height=4, channels=3, dtype="uint8", pitch=12, generation=1)
    lane = _Lane()
    worker = FrameWorker(PassthroughSession, lambda *a, **k: True, lane)
    worker.session = PassthroughSession()
    worker._install(TcpRing(RingSpec(dir="in", **spec)))
    worker._install(TcpRing(RingSpec(dir="out", **spec)))
    worker._process(worker.ring_in, 0, 1, 1, [b"\0" * 10])  # 10 bytes for a 48-byte frame
    worker._process(worker.ring_in, 1, 2, 1, [b"\0" * 47])
    assert lane.releases == [(0, 1, True), (1, 1, True)]  # both slots back, marked dropped
    assert worker.counts["errors"] == 2 and "the ring's frames have 48" in worker.error
    good = np.full((4, 4, 3), 7, np.uint8)
    worker._process(worker.ring_in, 0, 3, 1, [good.tobytes()])  # the stream goes on in a slot handed back
    assert lane.releases[-1] == (0, 1, False) and worker.counts["frames_in"] == 1
