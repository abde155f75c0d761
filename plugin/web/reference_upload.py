"""A reference image the page uploads (VACE): checked before anything decodes it.

The page sends the file's bytes, base64, in one control message. A show must not stall or run out of
memory on a wrong pick (a video, a huge photo, a crafted PNG that inflates to gigabytes), so the size
of the file, its kind (PNG or JPEG, by its signature) and its sides (read from its header) are checked
first, and only a file that passes is decoded. Each refusal is one line naming what was wrong and what
is allowed; the reference in use stays and the stream goes on.
"""

from __future__ import annotations

import base64
import binascii
import struct
from typing import Any

import numpy as np

from loom_live.host_bridge.wire.protocol import MAX_REFERENCE_SIDE
from loom_live.plugin.player.controls import ControlError

MAX_UPLOAD_BYTES = 8 * 1024 * 1024  # the file; its message is a third larger (base64)
MAX_NAME = 120
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JPEG_SOI = b"\xff\xd8"
# JPEG frame headers (SOF0..SOF15) carry the sides; C4 (Huffman tables), C8 and CC (arithmetic) do not
JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# markers with no length after them (TEM, RST0..7), read as the decoder reads them: taken for segments with a
# length, they would make the walk skip the real frame header and read a small one planted after it
JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})


def decode_upload(name: Any, data: Any) -> tuple[str, np.ndarray]:
    """The page's upload (file name, base64 bytes) as (name, uint8 RGB [H, W, 3]); ControlError if it is not
    a PNG or JPEG image of at most MAX_UPLOAD_BYTES and MAX_REFERENCE_SIDE px a side."""
    name = str(name)[:MAX_NAME] if isinstance(name, str) and name.strip() else "upload"
    if not isinstance(data, str) or not data:
        raise ControlError(f"reference {name}: no image data; expected a PNG or JPEG file")
    if len(data) > (MAX_UPLOAD_BYTES + 2) // 3 * 4:
        raise ControlError(f"reference {name}: over {MAX_UPLOAD_BYTES // (1024 * 1024)} MB; expected a smaller "
                           "PNG or JPEG file")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ControlError(f"reference {name}: the data is not base64 (the page sends the file's bytes so)") from None
    width, height = image_sides(raw, name)
    if max(width, height) > MAX_REFERENCE_SIDE or min(width, height) < 1:
        raise ControlError(f"reference {name}: {width}x{height}; expected 1 to {MAX_REFERENCE_SIDE} px a side")
    import cv2

    bgr = cv2.imdecode(np.frombuffer(raw, np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        raise ControlError(f"reference {name}: a damaged image (it does not decode); expected a PNG or JPEG file")
    return name, cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def image_sides(raw: bytes, name: str = "upload") -> tuple[int, int]:
    """(width, height) from a PNG's or a JPEG's header, without decoding it; ControlError for another kind."""
    if raw.startswith(PNG_SIGNATURE) and len(raw) >= 24 and raw[12:16] == b"IHDR":
        return struct.unpack(">II", raw[16:24])
    if raw.startswith(JPEG_SOI):
        sides = _jpeg_sides(raw)
        if sides is not None:
            return sides
    raise ControlError(f"reference {name}: not a PNG or JPEG image; expected a PNG or JPEG file")


def _jpeg_sides(raw: bytes) -> tuple[int, int] | None:
    """Walk the JPEG's marker segments to its frame header."""
    i = 2
    while i + 4 <= len(raw):
        if raw[i] != 0xFF:
            return None
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
