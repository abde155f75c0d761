"""The wire format between a host and the engine: versioned JSON control messages and the ring description.

Both sides import this one module, so the schema is written once. Every received message goes
through `decode`, which refuses (raises `ProtocolError`) anything oversized, not UTF-8 JSON, not
an object, from another protocol version, of an unknown type, with unknown or missing fields, or
with a field of the wrong type or range. A refusal never changes state on the receiving side; the
receiver counts it and carries on, so a buggy or hostile peer cannot crash or wedge either end.

Pure Python (no numpy): TouchDesigner's interpreter and the engine share it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from loom_live.host_bridge.wire.params import (
    CONTROL_SOURCES,
    LIVE,
    PROMPT,
    PROMPT_TAKES,
    TRANSITION_CHUNKS,
    LiveParam,
    check_prompt_request,
)

# 2: a frame lane socket for notices; 3: or a shared-memory doorbell on one machine; 4: a served engine
# answers only the host it serves, and tells a host that says hello meanwhile that it waits (`wait`);
# 5: its frame lane too (the host's lane connects as the `lane_id` the engine's hello names); 6: VACE control
# frames beside the input (a `control` input ring, the frame notice's `control`) and a live `reference` image;
# 7: a cuda-ipc ring's `read_events` (a reader that queued its read without waiting records one; the next writer
# of that slot waits for it on the GPU)
PROTOCOL_VERSION = 7
MAX_MESSAGE_BYTES = 64 * 1024  # control messages are small; frames travel in rings or payload parts
MAX_PAYLOAD_BYTES = 512 * 1024 * 1024  # one tcp frame part (an 8K float32 RGBA frame is 531 MB: refuse)
MAX_SLOTS = 16
MAX_FRAME_SIDE = 16384  # the longest side a ring slot may have (hosts downscale larger frames first)
MAX_TEXT = 4096
MAX_ENDPOINT = 256
MAX_REFERENCE_SIDE = 4096  # a reference image's longest side (the engine maps it to the model size)
LANE_MESSAGES = ("frame", "release")  # the only types the frame lane carries, and the control channel refuses
NOTICE_DIRS = {"host": ("in", "out"), "engine": ("out", "in")}  # side -> (dir of its frames, of its releases)

DTYPES = ("uint8", "uint16", "float32")
DTYPE_SIZES = {"uint8": 1, "uint16": 2, "float32": 4}
TRANSPORTS = ("shm", "cuda-ipc", "tcp")
ORIENTATIONS = ("top-down", "bottom-up")
CHANNEL_ORDERS = {1: ("R",), 3: ("RGB", "BGR"), 4: ("RGBA", "BGRA")}
ENCODINGS = ("raw", "jpeg")
DIRECTIONS = ("in", "out")  # "in" = host -> engine, "out" = engine -> host
SEGMENT_NAME = re.compile(r"loom_\d{1,10}_[0-9a-f]{1,32}")  # shm ring and doorbell segments
LANE_ID = re.compile(r"[0-9a-f]{32}")  # a served engine's frame lane: the identity its attached host connects as


class ProtocolError(ValueError):
    """A message this side refuses; the text says which field was wrong and what is allowed."""


# ---------------------------------------------------------------------------------------------
# field checkers: each returns None when the value is fine, or a text saying what is allowed


def _int(lo: int = 0, hi: int = 2**62) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        ok = isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi
        return None if ok else f"an integer in [{lo}, {hi}]"
    return check


def _num(lo: float = -1e300, hi: float = 1e300) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        # an int is compared as it is: math.isfinite() raises OverflowError on one of 400 digits
        number = isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and math.isfinite(v)
        return None if number and lo <= v <= hi else f"a finite number in [{lo}, {hi}]"
    return check


def _str(max_len: int = 256, min_len: int = 0) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        ok = isinstance(v, str) and min_len <= len(v) <= max_len
        return None if ok else f"a string of {min_len} to {max_len} characters"
    return check


def _choice(*allowed: Any) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if isinstance(v, str) and v in allowed else "one of " + ", ".join(map(repr, allowed))
    return check


def _endpoint(v: Any) -> str | None:
    ok = isinstance(v, str) and len(v) <= MAX_ENDPOINT and v.startswith(("tcp://", "ipc://"))
    return None if ok else f"a tcp:// or ipc:// endpoint of at most {MAX_ENDPOINT} characters"


def _lane_id(v: Any) -> str | None:
    ok = isinstance(v, str) and LANE_ID.fullmatch(v) is not None
    return None if ok else "a lane id of 32 hex digits"


def _segment(v: Any) -> str | None:
    ok = isinstance(v, str) and SEGMENT_NAME.fullmatch(v) is not None
    return None if ok else "a shared-memory segment name loom_<pid>_<hex>"


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "true or false"


def _opt(inner: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v is None else (None if inner(v) is None else f"null or {inner(v)}")
    return check


def _str_list(max_items: int, max_len: int) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        ok = isinstance(v, list) and len(v) <= max_items and all(isinstance(s, str) and len(s) <= max_len for s in v)
        return None if ok else f"a list of at most {max_items} strings of at most {max_len} characters"
    return check


def _json_object(v: Any) -> str | None:
    return None if isinstance(v, dict) and all(isinstance(k, str) for k in v) else "a JSON object"


def _live(param: LiveParam) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if param.problem(v) is None else param.allowed()
    return check


def _live_params(v: Any) -> str | None:
    problem = LIVE.problem(v)
    return None if problem is None else f"live parameters ({problem})"


def _ring_spec(v: Any) -> str | None:
    if not isinstance(v, dict):
        return "a ring description object"
    try:
        RingSpec.from_dict(v)
    except ProtocolError as exc:
        return f"a valid ring description ({exc})"
    return None



# field name -> (checker, required)
Fields = dict[str, tuple[Callable[[Any], str | None], bool]]
_ID: Fields = {"id": (_opt(_int()), False)}

SCHEMA: dict[str, Fields] = {
    # handshake: each side sends hello once (a host connecting to a served engine repeats it until answered:
    # the engine takes one host at a time); the engine sends ready when its session is built. The side
    # that bound the control endpoint also bound the frame lane and names it in `lane`; a host on shm or
    # cuda-ipc names its doorbell segment instead (frame notices then travel through it, not a lane). A
    # served engine's hello also gives `lane_id`: the identity the host's lane connects as, the only peer
    # its lane sends to or takes notices from
    "hello": {"role": (_choice("host", "engine"), True), "token": (_str(128), True), "pid": (_int(0, 2**31), True),
              "transports": (_str_list(8, 16), False), "gpu_uuids": (_str_list(64, 64), False),
              "software": (_str(128), False), "lane": (_endpoint, False), "lane_id": (_lane_id, False),
              "doorbell": (_segment, False)},
    # info: "session" (its class name) and "start": what the session starts on, its config's prompt and
    # live parameters, its model family (what its prompt is) and structure control, {"prompt": text,
    # "params": {name: value}, "family": name, "control_sources": [source], "takes_reference": bool}
    # (`LoomConfig.start_settings`; an older engine says no start, or no family or structure control: `ready_start`)
    "ready": {"info": (_json_object, False)},
    # a served engine's only answer to a host that says hello while another host is attached
    "wait": {"reason": (_str(MAX_TEXT), False)},
    "status": {"state": (_choice("loading", "running", "error"), True), "message": (_str(MAX_TEXT), False),
               "progress": (_opt(_num(0.0, 1.0)), False)},
    "heartbeat": {"t": (_num(0.0), True), "busy_s": (_opt(_num(0.0)), False)},
    "bye": {"reason": (_str(MAX_TEXT), False)},
    # data plane notices: on the frame lane (or as doorbell records) only
    "ring": {**_ID, "spec": (_ring_spec, True)},
    "frame": {"dir": (_choice(*DIRECTIONS), True), "slot": (_int(0, MAX_SLOTS - 1), True),
              "seq": (_int(), True), "gen": (_int(), True), "t": (_num(0.0), False),
              "nbytes": (_opt(_int(0, MAX_PAYLOAD_BYTES)), False),
              # an input slot of a control ring holds the frame's control frame too (see RingSpec.control)
              "control": (_bool, False)},
    "release": {"dir": (_choice(*DIRECTIONS), True), "slot": (_int(0, MAX_SLOTS - 1), True),
                "gen": (_int(), True), "dropped": (_bool, False)},
    # session control (requests may carry an id; the engine answers ack or error with it); prompt and
    # parameter values are checked against the live-parameter schema (params.py), a refused prompt said in the
    # words of the engine's model family (`_refusal`)
    "prompt": {**_ID, "text": (_live(PROMPT), True), "transition_chunks": (_opt(_live(TRANSITION_CHUNKS)), False)},
    "params": {**_ID, "params": (_live_params, True)},
    "mode": {**_ID, "lossless": (_bool, True)},
    # VACE: a new reference image, from the next chunk on; uint8 RGB top-down rows in one payload part
    # (width * height * 3 bytes), or `clear` without a payload to stream without one
    "reference": {**_ID, "width": (_opt(_int(1, MAX_REFERENCE_SIDE)), False),
                  "height": (_opt(_int(1, MAX_REFERENCE_SIDE)), False), "clear": (_bool, False)},
    # flush: `seq` = the last frame notice sent before it (on the lane); the engine waits for that notice
    "flush": {**_ID, "seq": (_opt(_int()), False)},
    "flushed": {**_ID, "count": (_int(), True)},
    "reset": {**_ID},
    "stats": {**_ID, "data": (_opt(_json_object), False)},
    "ack": {**_ID},
    "error": {**_ID, "code": (_str(64, 1), True), "message": (_str(MAX_TEXT), True)},
}
# a host's requests: the engine answers each that carries an id (ack, flushed, stats or error), one that `decode`
# refuses too (`request_id`)
REQUESTS = ("ring", "prompt", "params", "mode", "reference", "flush", "reset", "stats")


def make(type_: str, **fields: Any) -> dict[str, Any]:
    """A message dict, validated, so a sender cannot put a malformed message on the wire."""
    msg = {"v": PROTOCOL_VERSION, "type": type_, **{k: v for k, v in fields.items() if v is not None}}
    validate(msg)
    return msg


def encode(msg: dict[str, Any]) -> bytes:
    data = json.dumps(msg, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return data


def _refuse_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not allowed in messages")


def decode(parts: list[bytes], family: str | None = None) -> dict[str, Any]:
    """Parse and validate one received multipart message; raise ProtocolError to refuse it. `family`: the
    receiving engine's model family, in whose words a refused prompt is said (`validate`)."""
    if not parts:
        raise ProtocolError("empty message")
    head = parts[0]
    if len(head) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(head)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        msg = json.loads(head.decode("utf-8"), parse_constant=_refuse_constant)
    except ProtocolError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"not a UTF-8 JSON message ({type(exc).__name__})") from None
    try:
        validate(msg, family)
    except ProtocolError:
        raise
    except Exception as exc:  # a checker that trips over an odd value still refuses, never crashes the receiver
        raise ProtocolError(f"unreadable message ({type(exc).__name__})") from None
    allowed_parts = (1, 2) if msg["type"] in ("frame", "reference") else (1,)
    if len(parts) not in allowed_parts:
        raise ProtocolError(f"{msg['type']}: {len(parts)} parts; expected {' or '.join(map(str, allowed_parts))}")
    if msg["type"] == "reference":
        check_reference(msg, parts[1:])
    if msg["type"] == "frame":
        payload = len(parts) == 2
        if payload != (msg.get("nbytes") is not None):
            raise ProtocolError("frame: a payload part needs nbytes and nbytes needs a payload part")
        if payload and len(parts[1]) != msg["nbytes"]:
            raise ProtocolError(f"frame: payload has {len(parts[1])} bytes, nbytes says {msg['nbytes']}")
    return msg


def ready_start(info: Any) -> dict[str, Any] | None:
    """What a ready message's `info` says its session starts on, as far as this side reads it: {"prompt": text,
    "params": {name: value}} (only the live parameters this side knows, with allowed values) and, each where said,
    "family" (one this side knows), "control_sources" (those this side knows) and "takes_reference". A field left
    out or unreadable is not said (an older engine's); None where no start with a prompt and parameters is said."""
    start = info.get("start") if isinstance(info, dict) else None
    if not isinstance(start, dict) or PROMPT.problem(start.get("prompt")) is not None \
            or not isinstance(start.get("params"), dict):
        return None
    params = {k: LIVE[k].check(v) for k, v in start["params"].items() if k in LIVE and LIVE[k].problem(v) is None}
    said: dict[str, Any] = {"prompt": start["prompt"].strip(), "params": params}
    if start.get("family") in PROMPT_TAKES:
        said["family"] = start["family"]
    sources = start.get("control_sources")
    if isinstance(sources, list) and all(isinstance(s, str) for s in sources):
        said["control_sources"] = [s for s in CONTROL_SOURCES if s in sources]
    if isinstance(start.get("takes_reference"), bool):
        said["takes_reference"] = start["takes_reference"]
    return said


def request_id(parts: list[bytes]) -> tuple[str, int] | None:
    """The type and id of a received message, refused or not, that is a request whose sender waits for the
    answer: one of REQUESTS with an id the schema allows, read as far as that takes. The engine answers one that
    `decode` refused with the refusal, so a waiting host hears why (an engine of another version refusing a
    value) instead of waiting out its timeout; anything else is never answered, so no two peers answer each other."""
    if not parts or len(parts[0]) > MAX_MESSAGE_BYTES:
        return None
    try:
        msg = json.loads(parts[0].decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError):  # ProtocolError (a constant) is a ValueError
        return None
    if not isinstance(msg, dict) or msg.get("type") not in REQUESTS or msg.get("id") is None:
        return None
    return None if _ID["id"][0](msg["id"]) else (msg["type"], msg["id"])


def check_reference(msg: dict[str, Any], payload: list[bytes]) -> None:
    """A reference message is either `clear` alone or a size with exactly its RGB bytes as the payload."""
    if msg.get("clear"):
        if payload or "width" in msg or "height" in msg:
            raise ProtocolError("reference: clear takes no image (no width, height or payload)")
        return
    if "width" not in msg or "height" not in msg or len(payload) != 1:
        raise ProtocolError("reference: give width, height and the image as one payload part, or clear")
    want = msg["width"] * msg["height"] * 3
    if len(payload[0]) != want:
        raise ProtocolError(f"reference: payload has {len(payload[0])} bytes; a {msg['width']}x{msg['height']} "
                            f"RGB image has {want}")


def validate(msg: Any, family: str | None = None) -> None:
    """Refuse (ProtocolError) a message that breaks the schema, naming the field and what it takes; a prompt's
    text in the words of the receiving engine's model `family` (None: each family's), as a host says it."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a JSON object, got {type(msg).__name__}")
    v = msg.get("v")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(f"v: {v!r}; expected the protocol version {PROTOCOL_VERSION}")
    if v != PROTOCOL_VERSION:
        newer = "a newer" if v > PROTOCOL_VERSION else "an older"
        raise ProtocolError(f"v: {v} is {newer} protocol version; this side speaks {PROTOCOL_VERSION}")
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in SCHEMA:
        raise ProtocolError(f"type: {str(kind)[:40]!r} is unknown; allowed: {', '.join(SCHEMA)}")
    fields = SCHEMA[kind]
    for key, value in msg.items():
        if key in ("v", "type"):
            continue
        if key not in fields:
            raise ProtocolError(f"{kind}.{key[:40]}: unknown field; allowed: {', '.join(fields) or 'none'}")
        problem = fields[key][0](value)
        if problem:
            raise ProtocolError(_refusal(f"{kind}.{key}", value, problem, family))
    for key, (_, required) in fields.items():
        if required and key not in msg:
            raise ProtocolError(f"{kind}.{key}: missing")


def _refusal(name: str, value: Any, allowed: str, family: str | None) -> str:
    """Why field `name` refuses `value`. A prompt's text is said as a host says it (`check_prompt_request`, one
    wording for both): an edit engine asked for "a non-empty text" takes an instruction, not a style."""
    if name == "prompt.text":
        try:
            check_prompt_request(value, family=family)
        except ValueError as exc:
            return f"{name}: {exc}"
    return f"{name}: {str(value)[:60]!r} is not allowed; expected {allowed}"


# ---------------------------------------------------------------------------------------------
# ring description


@dataclass(frozen=True)
class RingSpec:
    """One direction's ring of frame slots, sent once per generation (a new generation = new slots).

    `handles` name the shared memory (shm segment names, or hex CUDA IPC memory handles); `events`
    are the hex CUDA IPC event handles, one per slot, that a writer records after its copy into the slot;
    `read_events` one more per slot, that a reader records after a copy out it did not wait for (the next
    write into the slot waits for it). `pitch` is the byte length of one row in a slot.
    `control` (an input ring of a VACE host): each slot holds a frame and its control frame, so `height`
    is twice the frame's; in the engine's orientation (after `orientation` is applied) the upper half is
    the frame, the lower half the control frame, valid where the frame notice says `control`.
    """

    transport: str
    dir: str
    slots: int
    width: int
    height: int
    channels: int
    dtype: str
    pitch: int
    generation: int
    orientation: str = "top-down"
    order: str = "RGB"
    handles: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    read_events: list[str] = field(default_factory=list)
    gpu_uuid: str | None = None
    encoding: str = "raw"
    jpeg_quality: int = 90
    control: bool = False

    @property
    def row_bytes(self) -> int:
        return self.width * self.channels * DTYPE_SIZES[self.dtype]

    @property
    def frame_height(self) -> int:
        """Rows of one frame: half the slot's on a control ring."""
        return self.height // 2 if self.control else self.height

    @property
    def half_rows(self) -> tuple[int, int]:
        """A control ring slot's first memory row of the frame and of its control frame: the frame is the
        upper half in the engine's orientation, so in a bottom-up slot it is the lower half in memory."""
        if not self.control:
            raise ValueError(f"ring generation {self.generation} holds no control frames")
        rows = self.frame_height
        return (rows, 0) if self.orientation == "bottom-up" else (0, rows)

    @property
    def slot_bytes(self) -> int:
        return self.pitch * self.height

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RingSpec:
        checks: Fields = {
            "transport": (_choice(*TRANSPORTS), True), "dir": (_choice(*DIRECTIONS), True),
            "slots": (_int(1, MAX_SLOTS), True), "width": (_int(1, MAX_FRAME_SIDE), True),
            "height": (_int(1, MAX_FRAME_SIDE), True),
            "channels": (_int(1, 4), True), "dtype": (_choice(*DTYPES), True), "pitch": (_int(1, 2**20), True),
            "generation": (_int(), True), "orientation": (_choice(*ORIENTATIONS), False),
            "order": (_str(4, 1), False), "handles": (_str_list(MAX_SLOTS, 256), False),
            "events": (_str_list(MAX_SLOTS, 256), False), "read_events": (_str_list(MAX_SLOTS, 256), False),
            "gpu_uuid": (_opt(_str(64)), False),
            "encoding": (_choice(*ENCODINGS), False), "jpeg_quality": (_int(1, 100), False),
            "control": (_bool, False),
        }
        for key, value in data.items():
            if key not in checks:
                raise ProtocolError(f"ring.{str(key)[:40]}: unknown field")
            problem = checks[key][0](value)
            if problem:
                raise ProtocolError(f"ring.{key}: {str(value)[:60]!r}; expected {problem}")
        for key, (_, required) in checks.items():
            if required and key not in data:
                raise ProtocolError(f"ring.{key}: missing")
        spec = cls(**data)
        if spec.channels not in CHANNEL_ORDERS or spec.order not in CHANNEL_ORDERS[spec.channels]:
            raise ProtocolError(f"ring.order: {spec.order!r} with {spec.channels} channels; expected one of "
                                f"{CHANNEL_ORDERS.get(spec.channels, ())}")
        if spec.pitch < spec.row_bytes:
            raise ProtocolError(f"ring.pitch: {spec.pitch} is smaller than a row ({spec.row_bytes} bytes)")
        if spec.control and (spec.dir != "in" or spec.height % 2):
            raise ProtocolError(f"ring.control: a {spec.dir} ring of height {spec.height}; control rings are input "
                                "rings of an even height (a frame above its control frame)")
        if spec.encoding == "jpeg" and (spec.transport != "tcp" or spec.dtype != "uint8" or spec.channels != 3):
            raise ProtocolError("ring.encoding: jpeg needs the tcp transport and uint8 RGB frames")
        return spec
