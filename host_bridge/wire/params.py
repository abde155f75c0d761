"""The live parameters: what a host may change while the engine streams, declared once.

Every reader of a live parameter takes its facts from here: the engine's config (`engine/config.py`
fields are built with `LiveParam.field`), the wire protocol (a `params` message is checked with
`LIVE.problem`), the real and the pass-through sessions, the player's keys, options and OSC, the
TouchDesigner page and the ComfyUI node. So a range, a default or a step list is written once, and
every host offers the same values and refuses the same mistakes with the same words.

A model family with parameters of its own registers them in a `ParamSchema` of its own built on
`LIVE` (`LIVE.extended(...)`), or adds them to `LIVE` with `register`; a LoRA scale is one more
`LiveParam` of kind "float" per adapter, in a section of its own. Pure Python: TouchDesigner's
interpreter and the engine both import it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

KINDS = ("int", "float", "bool", "choice", "text", "timesteps", "scales")
TRAIN_TIMESTEPS = 1000  # the flow-matching timestep scale the step lists are written in
MAX_STEPS = 4

# Step lists by number of denoising steps (StreamDiffusionV2's video-to-video schedules): what a
# host that offers "number of steps" sends.
STEP_LISTS: dict[int, tuple[int, ...]] = {1: (700,), 2: (700, 500), 3: (700, 500, 400), 4: (700, 500, 400, 200)}

# The engine's chunks in frames: the Wan VAE's causal first frame plus one group of 4, then groups of 4.
NAME_LEN = 64  # a LoRA's name for live control
FIRST_CHUNK_FRAMES = 5
CHUNK_FRAMES = 4


def whole_chunks(chunks: int) -> int:
    """Frames that make exactly `chunks` engine chunks from the stream's start (nothing padded by a flush)."""
    if chunks < 1:
        raise ValueError(f"chunks: {chunks}; expected at least 1")
    return FIRST_CHUNK_FRAMES + CHUNK_FRAMES * (chunks - 1)


@dataclass(frozen=True)
class LiveParam:
    """One live parameter: its name on the wire, kind, allowed values, default and where the engine keeps it.

    `section` is the engine config section that holds it (`stream`, `noise`, `prompt`, `slo`, or a
    family's own). `ui_step` is the increment a key or slider moves it by; `ui_max` caps a slider
    when the allowed maximum is far beyond useful values (the value itself may still go to `max`).
    """

    name: str
    kind: str
    default: Any
    section: str
    doc: str = ""
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    min_len: int | None = None
    max_len: int | None = None
    ui_step: float | None = None
    ui_max: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is unknown; allowed: {', '.join(KINDS)}")
        if self.problem(self.default) is not None:
            raise ValueError(f"{self.name}: the default {self.default!r} is not {self.allowed()}")

    def allowed(self) -> str:
        """What the parameter takes, in words, for error messages and help texts."""
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return "one of " + ", ".join(map(repr, self.choices))
        if self.kind == "text":
            return f"a non-empty text of at most {self.max_len} characters"
        if self.kind == "timesteps":
            return (f"a descending list of {self.min_len} to {self.max_len} whole timesteps in "
                    f"[{_num(self.min)}, {_num(self.max)}], such as {list(self.default)}")
        if self.kind == "scales":
            return (f"a mapping of at most {self.max_len} names (1 to {NAME_LEN} characters) to numbers in "
                    f"[{_num(self.min)}, {_num(self.max)}]")
        what = "a whole number" if self.kind == "int" else "a number"
        return f"{what} in [{_num(self.min)}, {_num(self.max)}]"

    def allowed_each(self) -> str:
        """What one scale of a "scales" parameter takes: a slider or an OSC message sets one LoRA's scale by name,
        and is refused in these words, not in `allowed`'s mapping of them that the wire carries."""
        return f"a number in [{_num(self.min)}, {_num(self.max)}]"

    def problem(self, value: Any) -> str | None:
        """None when `value` is allowed, else a text naming the parameter, the value and what is allowed."""
        if not self._ok(value):
            return f"{self.name}: {str(value)[:60]!r} is not allowed; expected {self.allowed()}"
        return None

    def check(self, value: Any) -> Any:
        """The value as the engine takes it (a list for timesteps, a float for a float); ValueError if refused."""
        problem = self.problem(value)
        if problem is not None:
            raise ValueError(problem)
        if self.kind == "timesteps":
            return [int(t) for t in value]
        if self.kind == "float":
            return float(value)
        if self.kind == "scales":
            return {str(k): float(v) for k, v in value.items()}
        return value.strip() if self.kind == "text" else value

    def field(self) -> Any:
        """A typed-config dataclass field with this parameter's default and constraints (engine config)."""
        from loom_live.host_bridge.wire.typed_config import spec

        meta = {k: v for k, v in (("min", self.min), ("max", self.max), ("min_len", self.min_len),
                                  ("max_len", self.max_len)) if v is not None}
        if self.choices:
            meta["choices"] = self.choices
        if self.kind == "timesteps":
            default = list(self.default)
            return spec(default_factory=lambda: list(default), doc=self.doc, allowed=self.allowed(), **meta)
        return spec(self.default, doc=self.doc, **meta)

    def _ok(self, v: Any) -> bool:
        if self.kind == "bool":
            return isinstance(v, bool)
        if self.kind == "choice":
            return isinstance(v, str) and v in self.choices
        if self.kind == "text":
            return isinstance(v, str) and bool(v.strip()) and len(v) <= (self.max_len or 0)
        if self.kind == "scales":
            return (isinstance(v, Mapping) and len(v) <= (self.max_len or 0)
                    and all(isinstance(k, str) and 0 < len(k) <= NAME_LEN for k in v)
                    and all(self._in_range(x, whole=False) for x in v.values()))
        if self.kind == "timesteps":
            return (isinstance(v, (list, tuple)) and (self.min_len or 0) <= len(v) <= (self.max_len or 0)
                    and all(self._in_range(t, whole=True) for t in v)
                    and all(a > b for a, b in zip(v, v[1:])))
        return self._in_range(v, whole=self.kind == "int")

    def _in_range(self, v: Any, whole: bool) -> bool:
        number = isinstance(v, int) or (not whole and isinstance(v, float) and math.isfinite(v))
        if isinstance(v, bool) or not number:
            return False
        return (self.min is None or v >= self.min) and (self.max is None or v <= self.max)


def _num(x: float | None) -> str:
    return "-inf" if x is None else f"{x:g}"


class ParamSchema:
    """A registry of live parameters by name; what a `params` message may carry."""

    def __init__(self, *params: LiveParam) -> None:
        self._params: dict[str, LiveParam] = {}
        self.register(*params)

    def register(self, *params: LiveParam) -> None:
        """Add parameters (a model family's, a LoRA scale); a name already taken is an error."""
        for p in params:
            if p.name in self._params:
                raise ValueError(f"live parameter {p.name!r} is already registered")
            self._params[p.name] = p

    def extended(self, *params: LiveParam) -> ParamSchema:
        """A new schema with these parameters added to this one's (a family's view of the shared ones)."""
        return ParamSchema(*self._params.values(), *params)

    def __getitem__(self, name: str) -> LiveParam:
        return self._params[name]

    def __contains__(self, name: object) -> bool:
        return name in self._params

    def __iter__(self) -> Iterator[LiveParam]:
        return iter(self._params.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._params)

    def section(self, section: str) -> tuple[str, ...]:
        """Names of the parameters the engine keeps in config section `section`."""
        return tuple(p.name for p in self if p.section == section)

    def sections(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.section for p in self))

    def defaults(self) -> dict[str, Any]:
        return {p.name: p.check(p.default) for p in self}

    def problem(self, params: Any) -> str | None:
        """None when every key is a known parameter with an allowed value, else what is wrong."""
        if not isinstance(params, Mapping):
            return f"expected an object of parameters, got {type(params).__name__}"
        for key, value in params.items():
            if key not in self._params:
                return f"{str(key)[:40]!r}: unknown parameter; settable: {', '.join(self._params)}"
            problem = self._params[key].problem(value)
            if problem is not None:
                return problem
        return None

    def check(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters as the engine takes them; ValueError naming the first bad one."""
        problem = self.problem(params)
        if problem is not None:
            raise ValueError(problem)
        return {key: self._params[key].check(value) for key, value in params.items()}


STEPS = LiveParam("steps", "timesteps", STEP_LISTS[2], "stream", "denoising timesteps, descending",
                  min=1, max=TRAIN_TIMESTEPS - 1, min_len=1, max_len=MAX_STEPS)
MODE = LiveParam("mode", "choice", "auto", "stream", "stream-batch, sequential, or chosen by the SLO scheduler",
                 choices=("auto", "batch", "sequential"))
SINK_THRESHOLD = LiveParam("sink_threshold", "float", 0.2, "stream", "adaptive sink cosine threshold; <0 disables",
                           min=-1.0, max=1.0)
NOISE_SCALE = LiveParam("noise_scale", "float", 0.8, "noise", "s_init: noise strength for a static scene",
                        min=0.1, max=1.0, ui_step=0.05)
MOTION_AWARE = LiveParam("motion_aware", "bool", True, "noise", "less noise where the input moves")
TRANSITION_CHUNKS = LiveParam("transition_chunks", "int", 4, "prompt", "chunks over which a prompt change blends",
                              min=0, max=1000, ui_max=64)
TARGET_FPS = LiveParam("target_fps", "float", 0.0, "slo", "output FPS to sustain; 0 = as fast as possible",
                       min=0.0, max=1000.0)
LATENCY_BUDGET_MS = LiveParam("latency_budget_ms", "float", 500.0, "slo", "per-frame push-to-output budget",
                              min=1.0, max=60000.0)

# The prompt travels in its own message (`prompt`), not among the parameters.
PROMPT = LiveParam("text", "text", "a painting in the style of van gogh, vivid brush strokes", "prompt",
                   "the style prompt", min_len=1, max_len=4096)

# what a prompt is to each model family (model.family), said when one is refused
PROMPT_TAKES = {"wan": "a few words describing the style",
                "edit": "an instruction, such as 'make it a watercolor painting'"}

LORA_SCALES = LiveParam("lora_scales", "scales", {}, "lora", "scale of each loaded style LoRA, by name",
                        min=-4.0, max=4.0, max_len=8, ui_step=0.05, ui_max=2.0)
LORA_DEFAULT_SCALE = 1.0  # a LoRA loaded without a scale


def lora_name(path: str) -> str:
    """The name live controls use for a LoRA loaded without one: its file name without the extension."""
    return PurePath(path).stem
# The edit family's own (engine/edit, model.family=edit), kept in its config section `edit`.
ADAPTER_STRENGTH = LiveParam("adapter_strength", "float", 1.0, "edit", "temporal LLLite output multiplier",
                             min=0.0, max=2.0, ui_step=0.05)
COND_REFRESH_EVERY = LiveParam("cond_refresh_every", "int", 8, "edit",
                               "rebuild the adapter's flow-warped condition every N batches", min=1, max=10000,
                               ui_max=64)
PROMPT_REFRESH_EVERY = LiveParam("prompt_refresh_every", "int", 8, "edit",
                                 "re-encode instruction + frame every N batches (static prompt caching)",
                                 min=1, max=10000, ui_max=256)
EDIT_PARAMS = (ADAPTER_STRENGTH, COND_REFRESH_EVERY, PROMPT_REFRESH_EVERY)

# VACE structure control (the wan2.1-vace presets), kept in the config section `control`.
CONTROL_SOURCES = ("edges", "grey", "flow", "depth", "video")
CONTROL = LiveParam("control_source", "choice", "edges", "control",
                    "the control video: made from the input (edges, grey, flow, depth) or a video given with it",
                    choices=CONTROL_SOURCES)
CONTEXT_SCALE = LiveParam("context_scale", "float", 1.0, "control",
                          "how strongly the control video steers the structure; 0 = not at all",
                          min=0.0, max=2.0, ui_step=0.05)
CONTROL_PARAMS = (CONTROL, CONTEXT_SCALE)

LIVE = ParamSchema(STEPS, MODE, SINK_THRESHOLD, NOISE_SCALE, MOTION_AWARE, TRANSITION_CHUNKS, TARGET_FPS,
                   LATENCY_BUDGET_MS, LORA_SCALES, *EDIT_PARAMS, *CONTROL_PARAMS)

# Each model family's share of the schema (another family's parameters are refused by name): the Wan
# family's, with the `control` section where the model takes structure control (VACE blocks, or edges it
# reads); the edit family's own and the shared ones that mean the same thing there (the SLO targets).
WAN_PARAMS = tuple(p for p in LIVE if p.section in ("stream", "noise", "prompt", "slo", "lora"))
WAN_CONTROL_PARAMS = WAN_PARAMS + CONTROL_PARAMS
EDIT_FAMILY_PARAMS = (*EDIT_PARAMS, TARGET_FPS, LATENCY_BUDGET_MS)


def family_params(family: str, control: bool = False) -> tuple[LiveParam, ...]:
    """The live parameters a session of this model family takes (`control`: a Wan model with structure control)."""
    if family == "edit":
        return EDIT_FAMILY_PARAMS
    return WAN_CONTROL_PARAMS if control else WAN_PARAMS


def steps_for(count: Any) -> list[int]:
    """The step list of a number of steps (a host's 1..4 control); ValueError names a bad count."""
    if isinstance(count, bool) or not isinstance(count, int) or count not in STEP_LISTS:
        *head, last = STEP_LISTS
        raise ValueError(f"steps: {count!r} is not allowed; expected {', '.join(map(str, head))} or {last}")
    return list(STEP_LISTS[count])


def check_prompt_request(text: Any, transition_chunks: Any = None,
                         family: str | None = "wan") -> tuple[str, int | None]:
    """A prompt and its blend length as the engine takes them (text stripped); ValueError names a bad one and
    what the model `family` takes instead (an edit preset's prompt is an instruction, not a style). None: the
    family is not known yet (a host before its engine's ready message), so what each family takes is said."""
    if text is not None and not isinstance(text, str):
        raise ValueError(f"the prompt is {type(text).__name__} {text!r:.40}; expected a string, {_takes(family)}")
    if not text or not text.strip():
        raise ValueError(f"the prompt is empty; give {_takes(family)}")
    if len(text) > (PROMPT.max_len or 0):
        raise ValueError(f"the prompt has {len(text)} characters; expected at most {PROMPT.max_len}")
    chunks = None if transition_chunks is None else TRANSITION_CHUNKS.check(transition_chunks)
    return text.strip(), chunks


def _takes(family: str | None) -> str:
    """What a prompt is to the model `family`, or to each family when it is not known."""
    if family is None:
        return " or ".join(f"{takes} (the {name} family)" for name, takes in PROMPT_TAKES.items())
    return PROMPT_TAKES[family]


__all__ = ["CHUNK_FRAMES", "CONTROL_PARAMS", "CONTROL_SOURCES",
           "EDIT_PARAMS", "FIRST_CHUNK_FRAMES", "LIVE", "LORA_DEFAULT_SCALE", "LORA_SCALES",
           "LiveParam", "MAX_STEPS", "NAME_LEN", "PROMPT", "ParamSchema", "STEP_LISTS", "TRAIN_TIMESTEPS",
           "check_prompt_request", "lora_name", "steps_for", "whole_chunks"]
