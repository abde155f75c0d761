"""The wire's VACE parts: a control ring (frame above its control frame), the frame notice's `control`,
and the `reference` message with its image bytes; malformed ones are refused with what is allowed."""

from __future__ import annotations

import pytest

from loom_live.host_bridge.wire.protocol import PROTOCOL_VERSION, ProtocolError, RingSpec, decode, encode, make


def ring(**over) -> dict:
    spec = dict(transport="shm", dir="in", slots=2, width=4, height=6, channels=3, dtype="uint8", pitch=12,
                generation=1, control=True)
    return {**spec, **over}


def test_a_control_ring_is_an_input_ring_of_even_height():
    spec = RingSpec.from_dict(ring())
    assert spec.control and spec.frame_height == 3 and RingSpec.from_dict(ring(control=False)).frame_height == 6
    assert spec.half_rows == (0, 3) and RingSpec.from_dict(ring(orientation="bottom-up")).half_rows == (3, 0)
    with pytest.raises(ValueError, match="holds no control frames"):
        assert RingSpec.from_dict(ring(control=False)).half_rows
    for bad in (ring(dir="out"), ring(height=5)):
        with pytest.raises(ProtocolError, match="control rings are input rings of an even height"):
            RingSpec.from_dict(bad)


def test_frame_notices_say_whether_their_slot_holds_a_control_frame():
    msg = decode([encode(make("frame", dir="in", slot=0, seq=1, gen=1, control=True))])
    assert msg["control"] is True
    with pytest.raises(ProtocolError, match="frame.control"):
        decode([encode({**make("frame", dir="in", slot=0, seq=1, gen=1), "control": 1})])


def test_a_reference_message_carries_exactly_its_image_or_clears_it():
    head = encode(make("reference", width=2, height=3))
    assert decode([head, bytes(18)])["width"] == 2
    assert decode([encode(make("reference", clear=True))])["clear"] is True
    too_wide = encode({"v": PROTOCOL_VERSION, "type": "reference", "width": 5000, "height": 2})
    for parts, words in [([head], "one payload part"), ([head, bytes(17)], "has 17 bytes; a 2x3 RGB image has 18"),
                         ([encode(make("reference", clear=True)), b"x"], "clear takes no image"),
                         ([too_wide, bytes(30000)], "reference.width")]:
        with pytest.raises(ProtocolError, match=words):
            decode(parts)
