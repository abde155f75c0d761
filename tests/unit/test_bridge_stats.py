"""The bridge's output rate (`FrameStats.fps`), which the player's status line, the web page and
TouchDesigner show."""

import time

from loom_live.host_bridge.bridge_stats import FrameStats


def test_a_first_chunk_back_as_a_burst_reads_no_rate_rather_than_a_thousand_fps():
    stats = FrameStats()
    now = time.monotonic()
    for i in range(5):  # a stream's first chunk: five frames a millisecond apart
        stats.received(i, now - 0.005 + i * 0.001)
    assert stats.fps() == 0.0


def test_outputs_spread_over_time_read_their_rate():
    stats = FrameStats()
    now = time.monotonic()
    for i in range(11):  # ten intervals of 0.1 s: 10 FPS
        stats.received(i, now - 1.0 + i * 0.1)
    assert abs(stats.fps() - 10.0) < 1e-6
