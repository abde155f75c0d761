"""A reference image the page uploads (VACE): checked before anything decodes it.

The page sends the file's bytes, base64, in one control message. Its size is checked here, before the
base64 is read; its kind and sides (PNG or JPEG, from its header) in plugin/player/reference_image.py,
before it is decoded. Each refusal is one line naming what was wrong and what is allowed; the reference
in use stays and the stream goes on.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np

from loom_live.plugin.player.controls import ControlError
from loom_live.plugin.player.reference_image import check_reference, decode_image

MAX_UPLOAD_BYTES = 8 * 1024 * 1024  # the file; its message is a third larger (base64)
MAX_NAME = 120


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
    try:
        check_reference(raw, name)
    except ValueError as exc:
        raise ControlError(str(exc)) from None
    image = decode_image(raw)
    if image is None:
        raise ControlError(f"reference {name}: a damaged image (it does not decode); expected a PNG or JPEG file")
    return name, image
