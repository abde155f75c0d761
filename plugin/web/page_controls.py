"""The page's controls: what it may set (read off the live-parameter schema) and its messages as
player commands.

The page builds its sliders from `schema()`, so a range or a step list is written once, in
host_bridge/wire/params.py, for the page as for the keys, OSC, TouchDesigner and ComfyUI; the schema also names
the live parameter each control sets, so that the page hides a control the running engine does not take (the
state's `takes`), as the overlay leaves its setting out, rather than offer it only to be refused. A message
becomes the same `Command` a key or an OSC message would, through the same builders, so the page
is refused the same mistakes with the same words; the frame loop applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from loom_live.host_bridge.wire.params import (
    ADAPTER_STRENGTH,
    CONTEXT_SCALE,
    CONTROL,
    LORA_SCALES,
    NOISE_SCALE,
    PROMPT,
    STEP_LISTS,
    TRANSITION_CHUNKS,
)
from loom_live.plugin.player.controls import (
    SETS_PARAM,
    Command,
    ControlError,
    ControlState,
    UploadedReference,
    adapter_strength_command,
    context_scale_command,
    control_source_command,
    lora_scale_command,
    noise_scale_command,
    prompt_command,
    steps_command,
    transition_chunks_command,
)
from loom_live.plugin.web.reference_upload import MAX_UPLOAD_BYTES, decode_upload


def schema() -> dict[str, Any]:
    """The controls' allowed values, as the page needs them."""
    def slider(p: Any) -> dict[str, Any]:
        return {"min": p.min, "max": p.max, "step": p.ui_step or 1, "ui_max": p.ui_max or p.max,
                "allowed": p.allowed()}

    # a LoRA's slider sets one scale (lora_scale_command), not the mapping the wire carries
    lora = {**slider(LORA_SCALES), "allowed": LORA_SCALES.allowed_each()}
    return {"steps": sorted(STEP_LISTS), "noise_scale": slider(NOISE_SCALE),
            "transition_chunks": slider(TRANSITION_CHUNKS), "lora_scale": lora,
            "context_scale": slider(CONTEXT_SCALE), "control_source": list(CONTROL.choices),
            "adapter_strength": slider(ADAPTER_STRENGTH),
            "prompt_max_len": PROMPT.max_len, "reference_max_bytes": MAX_UPLOAD_BYTES,
            "params": {name: SETS_PARAM[name] for name in CONTROLS if name in SETS_PARAM}}


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ControlError(f"{what}: {value!r} is not allowed; expected true or false")
    return value


def _index(value: Any) -> Command:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ControlError(f"prompt index: {value!r} is not a whole number")
    return Command("prompt_index", (value,))


def _reference(message: Mapping[str, Any]) -> Command:
    """An uploaded reference image, checked and decoded here (off the frame loop)."""
    return Command("reference_image", (UploadedReference(*decode_upload(message.get("name"), message.get("data"))),))


def _prompt(message: Mapping[str, Any], family: str | None) -> Command:
    return prompt_command(message.get("text"), message.get("transition_chunks"), family=family)


_BUILDERS: dict[str, Callable[..., Command]] = {
    "prompt": _prompt,
    "prompt_index": lambda m: _index(m.get("value")),
    "steps": lambda m: steps_command(m.get("value")),
    "noise_scale": lambda m: noise_scale_command(m.get("value")),
    "motion_aware": lambda m: Command("motion_aware", (_flag(m.get("value"), "motion_aware"),)),
    "lora_scale": lambda m: lora_scale_command(m.get("name"), m.get("value")),
    "transition_chunks": lambda m: transition_chunks_command(m.get("value")),
    "context_scale": lambda m: context_scale_command(m.get("value")),
    "control_source": lambda m: control_source_command(m.get("value")),
    "adapter_strength": lambda m: adapter_strength_command(m.get("value")),
    "reference": _reference,
    "pause": lambda m: Command("pause", (_flag(m.get("value"), "pause"),)),
}
CONTROLS = tuple(_BUILDERS)


def command_for(message: Mapping[str, Any], family: str | None = "wan") -> Command:
    """The command a page's control message asks for; ControlError names what is wrong and what is allowed (a
    prompt in the words of the model `family`)."""
    name = message.get("control")
    builder = _BUILDERS.get(name) if isinstance(name, str) else None
    if builder is None:
        raise ControlError(f"unknown control {str(name)[:40]!r}; known: {', '.join(CONTROLS)}")
    return builder(message, family) if builder is _prompt else builder(message)


def control_state(s: ControlState) -> dict[str, Any]:
    """What the performer has set, for the page to show; `takes`: the live parameters the running engine takes
    (sorted), or None while any may be sent (an empty list: a served engine that has not said yet)."""
    return {"prompts": list(s.prompts), "prompt_index": s.prompt_index, "steps": s.steps,
            "noise_scale": s.noise_scale, "motion_aware": s.motion_aware, "transition_chunks": s.transition_chunks,
            "lora_scales": dict(s.lora_scales), "paused": s.paused, "message": s.message,
            "control_sources": list(s.control_sources), "control_source": s.control_source,
            "context_scale": s.context_scale, "takes_reference": s.takes_reference, "refused": s.refused,
            "adapter_strength": s.adapter_strength,
            "takes": None if s.takes is None else sorted(s.takes)}
