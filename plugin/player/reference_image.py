"""A reference image's bytes (VACE), checked before anything decodes them.

A show must not stall or run out of memory on a wrong pick (a huge photo, a crafted PNG that inflates to
gigabytes): a PNG's or JPEG's sides are read from its header first, and only a picture the bridge would
take is decoded. The player's file path (OSC, the r key) and the page's upload both come through here;
each refusal is a ValueError of one line naming what was wrong and what is allowed.
"""

from __future__ import annotations

import struct

import numpy as np

from loom_live.host_bridge.wire.protocol import MAX_REFERENCE_SIDE

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SOI = b"\xff\xd8"
# JPEG frame headers (SOF0..SOF15) carry the sides; C4 (Huffman tables), C8 and CC (arithmetic) do not
JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# markers with no length after them (TEM, RST0..7), read as the decoder reads them: taken for segments with a
# length, they would make the walk skip the real frame header and read a small one planted after it
JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})


def check_reference(raw: bytes, name: str, other_kinds: bool = False) -> None:
    """ValueError unless a PNG or JPEG of at most MAX_REFERENCE_SIDE a side, by its header; with `other_kinds`
    another format (a local file, which OpenCV may read) passes to the decoder unchecked."""
    sides = image_sides(raw)
    if sides is None and not (other_kinds and not raw.startswith((PNG_SIGNATURE, JPEG_SOI))):
        raise ValueError(f"reference {name}: not a PNG or JPEG image; expected a PNG or JPEG file")
    if sides is not None and (max(sides) > MAX_REFERENCE_SIDE or min(sides) < 1):
        raise ValueError(f"reference {name}: {sides[0]}x{sides[1]}; expected 1 to {MAX_REFERENCE_SIDE} px a side")


def decode_image(raw: bytes) -> np.ndarray | None:
    """Checked bytes as uint8 RGB [H, W, 3]; None when they do not decode."""
    import cv2

    bgr = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR) if raw else None
    return None if bgr is None else cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def image_sides(raw: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's or a JPEG's header, without decoding it; None for another kind."""
    if raw.startswith(PNG_SIGNATURE) and len(raw) >= 24 and raw[12:16] == b"IHDR":
        return struct.unpack(">II", raw[16:24])
    if raw.startswith(JPEG_SOI):
        return _jpeg_sides(raw)
    return None


def _jpeg_sides(raw: bytes) -> tuple[int, int] | None:
    """Walk the JPEG's marker segments to its frame header."""
    i = 2
    while i + 4 <= len(raw):
        if raw[i] != 0xFF:  # stray bytes before a marker: the decoder skips them to the next 0xFF, and so here
            i += 1
            continue
        marker = raw[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in JPEG_STANDALONE:
            i += 2
            continue
        if marker in (0xD8, 0xD9):  # a second start, or the end, before any frame header: not an image we read
            return None
        length = struct.unpack(">H", raw[i + 2:i + 4])[0]
        if length < 2:  # a length counts its own two bytes
            return None
        if marker in JPEG_SOF:
            if i + 9 > len(raw):
                return None
            height, width = struct.unpack(">HH", raw[i + 5:i + 9])
            return width, height
        i += 2 + length
    return None
