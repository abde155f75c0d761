"""The wire schema: valid messages round-trip, everything malformed is refused with a reason."""

from __future__ import annotations

import json

import pytest

from loom_live.host_bridge.wire.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    RingSpec,
    decode,
    encode,
    make,
    ready_start,
    request_id,
)

RING = dict(transport="shm", dir="in", slots=3, width=64, height=32, channels=3, dtype="uint8", pitch=192,
            generation=1, handles=["loom_0123456789abcdef"])


def _raw(obj) -> list[bytes]:
    return [json.dumps(obj).encode()]


def test_valid_messages_round_trip():
    msgs = [
        make("hello", role="engine", token="t", pid=12, transports=["shm", "tcp"], gpu_uuids=[]),
        make("hello", role="host", token="t", pid=12, lane="ipc:///tmp/loom-1-x/lane"),
        make("hello", role="host", token="t", pid=12, doorbell="loom_4242_0123456789ab"),
        make("flush", id=4, seq=99),
        make("ready", info={"session": "X"}),
        make("heartbeat", t=1.5, busy_s=0.2),
        make("ring", id=3, spec=RING),
        make("frame", dir="in", slot=2, seq=10, gen=1, t=2.0),
        make("release", dir="out", slot=0, gen=1),
        make("prompt", id=1, text="oil painting", transition_chunks=4),
        make("params", id=2, params={"steps": [700, 500], "noise_scale": 0.7}),
        make("error", id=2, code="params", message="steps: bad"),
        make("bye", reason="done"),
    ]
    for m in msgs:
        assert decode([encode(m)]) == m
    payload = b"\x01" * 100
    m = make("frame", dir="out", slot=0, seq=1, gen=1, nbytes=100)
    assert decode([encode(m), payload])["nbytes"] == 100


@pytest.mark.parametrize("obj, reason", [
    ({"v": PROTOCOL_VERSION + 1, "type": "hello"}, "newer protocol version"),
    ({"v": 0, "type": "hello"}, "older protocol version"),
    ({"type": "bye"}, "protocol version"),
    ({"v": PROTOCOL_VERSION, "type": "launch_missiles"}, "unknown"),
    ({"v": PROTOCOL_VERSION, "type": "bye", "extra": 1}, "bye.extra: unknown field"),
    ({"v": PROTOCOL_VERSION, "type": "frame", "dir": "in", "slot": 99, "seq": 0, "gen": 0}, "frame.slot"),
    ({"v": PROTOCOL_VERSION, "type": "frame", "dir": "in", "seq": 0, "gen": 0}, "frame.slot: missing"),
    ({"v": PROTOCOL_VERSION, "type": "prompt", "text": ""}, "prompt.text"),
    ({"v": PROTOCOL_VERSION, "type": "hello", "role": "host", "token": "", "pid": 1, "lane": "udp://h:1"},
     "hello.lane"),
    ({"v": PROTOCOL_VERSION, "type": "hello", "role": "host", "token": "", "pid": 1, "doorbell": "../../etc/x"},
     "hello.doorbell"),
    ({"v": PROTOCOL_VERSION, "type": "hello", "role": "host", "token": "", "pid": 1, "doorbell": "loom_1_ab\n"},
     "hello.doorbell"),
    ({"v": PROTOCOL_VERSION, "type": "heartbeat", "t": True}, "heartbeat.t"),
    ({"v": PROTOCOL_VERSION, "type": "ring", "spec": {**RING, "pitch": 10}}, "smaller than a row"),
    ({"v": PROTOCOL_VERSION, "type": "ring", "spec": {**RING, "order": "BGRA"}}, "ring.order"),
    ([1, 2, 3], "JSON object"),
])
def test_malformed_messages_are_refused_with_the_reason(obj, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode(_raw(obj))


def test_a_refused_prompt_is_said_in_the_words_of_the_receiving_engine_s_family():
    """A client that skips the bridge's check sends a blank prompt: an edit engine said it expected "a non-empty
    text", not the instruction it takes. Said as a host says it; without a family, what each one takes."""
    blank = _raw({"v": PROTOCOL_VERSION, "type": "prompt", "id": 1, "text": " \n"})
    edit = "an instruction, such as 'make it a watercolor painting'"
    for family, takes in (("edit", edit), ("wan", "a few words describing the style"),
                          (None, f"a few words describing the style (the wan family) or {edit} (the edit family)")):
        with pytest.raises(ProtocolError) as refused:
            decode(blank, family)
        assert str(refused.value) == f"prompt.text: the prompt is empty; give {takes}"
    for text, words in ((7, f"prompt.text: the prompt is int 7; expected a string, {edit}"),
                        ("x" * 4097, "prompt.text: the prompt has 4097 characters; expected at most 4096")):
        with pytest.raises(ProtocolError) as refused:
            decode(_raw({"v": PROTOCOL_VERSION, "type": "prompt", "text": text}), "edit")
        assert str(refused.value) == words
    assert decode(_raw({"v": PROTOCOL_VERSION, "type": "prompt", "text": " ink "}), "edit")["text"] == " ink "


def test_size_limit_non_json_nan_and_parts_are_refused():
    big = encode(make("bye", reason="x"))[:-2] + b"x" * MAX_MESSAGE_BYTES + b'"}'
    with pytest.raises(ProtocolError, match="limit"):
        decode([big])
    with pytest.raises(ProtocolError, match="JSON"):
        decode([b"\xff\xfe not json"])
    with pytest.raises(ProtocolError, match="NaN"):
        decode([b'{"v":1,"type":"heartbeat","t":NaN}'])
    with pytest.raises(ProtocolError, match="JSON"):
        decode([b"[" * 30000 + b"]" * 30000])
    with pytest.raises(ProtocolError, match="parts"):
        decode([encode(make("bye")), b"extra"])
    with pytest.raises(ProtocolError, match="nbytes"):
        decode([encode(make("frame", dir="in", slot=0, seq=0, gen=0)), b"payload"])
    with pytest.raises(ProtocolError, match="empty"):
        decode([])
    with pytest.raises(ProtocolError):
        make("frame", dir="sideways", slot=0, seq=0, gen=0)  # senders are validated too


def test_a_refused_request_is_answerable_only_as_a_request_with_a_valid_id():
    """`request_id` names what the engine answers when `decode` refuses it: a request whose id the schema allows,
    never a reply, a notice, an id-less or null-id request, nor what is not a readable JSON object."""
    bad_prompt = {"v": PROTOCOL_VERSION, "type": "prompt", "id": 7, "text": " "}
    with pytest.raises(ProtocolError):
        decode(_raw(bad_prompt))
    assert request_id(_raw(bad_prompt)) == ("prompt", 7)
    assert request_id(_raw({"v": PROTOCOL_VERSION + 1, "type": "params", "id": 3, "params": {"steps": "x"}})) \
        == ("params", 3)
    assert request_id([encode(make("reset", id=2)), b"an extra part"]) == ("reset", 2)
    for rid in (None, -1, 2**70, "7", True, 1.0):
        assert request_id(_raw({**bad_prompt, "id": rid})) is None
    no_id = {k: v for k, v in bad_prompt.items() if k != "id"}
    assert request_id(_raw(no_id)) is None
    for kind in ("ack", "error", "flushed", "hello", "heartbeat", "frame", "Prompt", None):
        assert request_id(_raw({**bad_prompt, "type": kind})) is None
    big = encode(bad_prompt)[:-1] + b',"x":"' + b"y" * MAX_MESSAGE_BYTES + b'"}'
    for parts in ([], [b"\xff not json"], _raw([bad_prompt]), [b"[" * 30000 + b"]" * 30000], [big],
                  [b'{"v":6,"type":"prompt","id":7,"text":NaN}'], [b'{"type":"prompt","id":1' + b"0" * 5000 + b"}"]):
        assert request_id(parts) is None


def test_the_ready_message_says_the_engine_s_structure_control_and_an_older_one_says_none():
    """The ready message's start names the control sources the session can make and whether it takes a reference
    image (`LoomConfig.start_settings`), read back by `ready_start` (`Bridge.engine_start`). An older engine's start
    without them, or values this side cannot read, say nothing of them (not: none); a source this side does not
    know is left out."""
    start = {"prompt": "ink", "params": {"context_scale": 0.5}, "family": "wan",
             "control_sources": ["edges", "grey", "depth"], "takes_reference": True}
    assert ready_start(decode([encode(make("ready", info={"session": "S", "start": start}))])["info"]) == start
    older = {"prompt": "ink", "params": {"noise_scale": 0.5}, "family": "wan"}
    assert ready_start(decode([encode(make("ready", info={"start": older}))])["info"]) == older
    assert ready_start({"start": {**older, "control_sources": "edges", "takes_reference": 1}}) == older
    assert ready_start({"start": {**older, "control_sources": [7], "takes_reference": None}}) == older
    assert ready_start({"start": {**older, "control_sources": ["scribble", "flow", "edges"]}})["control_sources"] \
        == ["edges", "flow"]
    none = {**older, "control_sources": [], "takes_reference": False}  # a model without structure control says so
    assert ready_start({"start": none}) == none
    for info in ({"session": "S"}, {"start": {"params": {}}}, {"start": {"prompt": "ink"}}, ["start"]):
        assert ready_start(info) is None


def test_ring_spec_describes_the_slots():
    spec = RingSpec.from_dict(RING)
    assert spec.row_bytes == 64 * 3 and spec.slot_bytes == 192 * 32
    assert RingSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ProtocolError, match="jpeg"):
        RingSpec.from_dict({**RING, "encoding": "jpeg"})
