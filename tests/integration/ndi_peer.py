"""A separate NDI process for test_ndi_loopback: `send NAME MARK` or `receive NAME N [READ_TIMEOUT]`.

NDI compresses (SpeedHQ, 4:2:2) even on loopback, so values come back near, not equal: a frame
carries its index as 16 black/white stripes in red, and its sender's MARK as the blue level (a
channel swap, or the wrong sender, shows). `receive` prints one JSON line per event:
{"frame": i, "blue": b, "shape": [...], "clean": bool} or {"message": "..."}.
"""

from __future__ import annotations

import json
import sys

import numpy as np

SIZE = (256, 64)
BITS = 16
STRIPE = SIZE[0] // BITS


def send(name: str, mark: int) -> None:
    from loom_live.plugin.media.ndi import NdiSink

    w, h = SIZE
    sink = NdiSink(name, 30.0, SIZE)
    frame = np.zeros((h, w, 3), np.uint8)
    frame[..., 2] = mark
    for i in range(2**BITS):
        for bit in range(BITS):
            frame[:, bit * STRIPE:(bit + 1) * STRIPE, 0] = 255 if i >> bit & 1 else 0
        sink.write(frame)


def decode(frame: np.ndarray) -> tuple[int, bool]:
    """The index in the stripes, and whether every stripe is clearly black or white."""
    centres = frame[:, STRIPE // 2::STRIPE, 0].astype(np.int16)  # one column per stripe, away from edges
    bits = centres.mean(axis=0) > 128
    clean = bool((np.abs(centres - 128) > 64).all())
    return sum(1 << b for b in range(BITS) if bits[b]), clean


def receive(name: str, n: int, read_timeout: float) -> None:
    from loom_live.plugin.media.ndi import NdiSource
    from loom_live.plugin.player.live_feed import LiveFeed

    def open_it() -> NdiSource:
        return NdiSource(name, open_timeout=15.0, read_timeout=read_timeout)

    feed = LiveFeed(open_it(), open_it)
    got = 0
    try:
        while got < n:
            frame = feed.next(timeout_s=0.5)
            for message in feed.messages():
                print(json.dumps({"message": message}), flush=True)
            if frame is None:
                continue
            index, clean = decode(frame)
            print(json.dumps({"frame": index, "shape": list(frame.shape), "clean": clean,
                              "blue": int(frame[..., 2].mean())}), flush=True)
            got += 1
    finally:
        feed.close()


if __name__ == "__main__":
    if sys.argv[1] == "send":
        send(sys.argv[2], int(sys.argv[3]))
    else:
        receive(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 5.0)
