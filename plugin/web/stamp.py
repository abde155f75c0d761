"""A frame counter stamped into a strip below the picture, so the page can time glass to glass.

The page draws each camera frame with this strip under it and remembers when; the host reads the
code off the frame it receives, keeps it with the frame through the engine (by the bridge's
sequence number), and stamps it again under the restyled picture it sends back. The page reads it
off the frame it shows and subtracts: camera frame to restyled frame on screen, in the page's own
clock, with no clock to synchronise. The restyle never sees the strip (the host crops it off).

The code is BITS blocks side by side across the strip's width, white for 1 and black for 0: a
white start block, the counter's CODE_BITS bits (most significant first), an even-parity block and
a black end block. Blocks are a sixteenth of the width each, so the code survives the video codecs
and any rescaling on the way; page.js writes and reads the same layout.
"""

from __future__ import annotations

import numpy as np

BITS = 16
CODE_BITS = BITS - 3  # start block, parity, end block
CODE_LIMIT = 1 << CODE_BITS  # codes run 1..CODE_LIMIT-1 and wrap; 0 means "no stamp"
STAMP_ROWS = 16  # the strip's height in pixels at the host's frame size


def encode(code: int, width: int, rows: int = STAMP_ROWS) -> np.ndarray:
    """The strip for `code` as uint8 RGB [rows, width, 3]; code 0 gives a blank (black) strip."""
    strip = np.zeros((rows, width, 3), np.uint8)
    if code <= 0:
        return strip
    for i, bit in enumerate(_blocks(code % CODE_LIMIT)):
        if bit:
            x0, x1 = _span(i, width)
            strip[:, x0:x1] = 255
    return strip


def decode(strip: np.ndarray) -> int:
    """The code in a strip (any size, RGB or grey), or 0 when it does not read as one."""
    grey = strip.mean(axis=2) if strip.ndim == 3 else strip.astype(np.float32)
    rows, width = grey.shape
    r0, r1 = rows // 4, max(rows // 4 + 1, rows - rows // 4)
    bits = []
    for i in range(BITS):
        x0, x1 = _span(i, width)
        inner = max(1, (x1 - x0) // 4)
        bits.append(int(grey[r0:r1, x0 + inner:x1 - inner].mean() > 127))
    if bits != _blocks(_value(bits[1:1 + CODE_BITS])):
        return 0
    return _value(bits[1:1 + CODE_BITS])


def _blocks(code: int) -> list[int]:
    data = [(code >> (CODE_BITS - 1 - i)) & 1 for i in range(CODE_BITS)]
    return [1, *data, sum(data) % 2, 0]


def _value(bits: list[int]) -> int:
    value = 0
    for bit in bits:
        value = (value << 1) | bit
    return value


def _span(i: int, width: int) -> tuple[int, int]:
    return i * width // BITS, (i + 1) * width // BITS
