"""The bridge's output rate (`FrameStats.fps`) and latency percentiles (`FrameStats.latency_ms`), which the
player's status line, the web page and TouchDesigner show."""

import random
import time

import numpy as np

from loom_live.host_bridge.bridge_stats import LATENCY_WINDOW, FrameStats


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


def test_latency_percentiles_follow_the_window_as_frames_come_and_go():
    """The percentiles are numpy's over the newest LATENCY_WINDOW latencies, repeats and all, however many
    frames went before; frames with no known submit time add none."""
    stats = FrameStats()
    rng = random.Random(0)
    latencies = []
    assert stats.latency_ms(50) == 0.0
    for seq in range(3 * LATENCY_WINDOW + 7):
        t0 = float(seq)
        stats.sent(seq, t0)
        lat = round(rng.uniform(0.001, 0.2), 3)  # rounded: equal latencies come and go too
        stats.received(seq, t0 + lat)
        stats.received(10**6 + seq, t0 + 1.0)  # an output whose input this host never sent
        latencies.append(lat)
        window = latencies[-LATENCY_WINDOW:]
        if seq % 37 == 0 or seq > 3 * LATENCY_WINDOW:
            for q in (0, 50, 99, 100):
                assert abs(stats.latency_ms(q) - float(np.percentile(window, q)) * 1000) < 1e-6, (seq, q)
