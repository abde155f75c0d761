"""The live parameters every Loom host exposes (player keys/OSC, TouchDesigner pars, ComfyUI inputs).

One definition so the three hosts offer the same ranges and send the engine the same values.
"""

from __future__ import annotations

from typing import Any

# Step lists by number of denoising steps (StreamDiffusionV2's video-to-video schedules).
STEP_LISTS: dict[int, list[int]] = {1: [700], 2: [700, 500], 3: [700, 500, 400], 4: [700, 500, 400, 200]}
NOISE_SCALE_RANGE = (0.1, 1.0)
DEFAULT_PROMPT = "a painting in the style of van gogh, vivid brush strokes"


def engine_params(steps: int, noise_scale: float, motion_aware: bool) -> dict[str, Any]:
    """The `Bridge.set_params` keywords for the host-level settings; ValueError names a bad one."""
    if steps not in STEP_LISTS:
        raise ValueError(f"steps: {steps} is not allowed; expected 1, 2, 3 or 4")
    lo, hi = NOISE_SCALE_RANGE
    if not lo <= noise_scale <= hi:
        raise ValueError(f"noise_scale: {noise_scale:g} is out of range; expected {lo}..{hi}")
    return {"steps": list(STEP_LISTS[steps]), "noise_scale": float(noise_scale), "motion_aware": bool(motion_aware)}


def prompt_request(text: Any, transition_chunks: Any = None) -> tuple[str, int | None]:
    """A prompt and its blend length as the engine takes them; ValueError names a bad one."""
    from host_bridge.wire.protocol import make  # the message's own limits (length, blend range)

    if not isinstance(text, str) or not text.strip():
        raise ValueError("the prompt is empty; give a few words describing the style")
    make("prompt", text=text.strip(), transition_chunks=transition_chunks)
    return text.strip(), transition_chunks


class ControlSync:
    """The newest prompt and parameters a host wants, delivered whenever an engine is running.

    The bridge sends a control message only to a running engine: one that is still starting, or
    a restarted process (fresh state), would never see a prompt set earlier. Hosts record what
    the user set here and call `sync(bridge)` from their frame loop; changes go out once, and
    everything is sent again to each new engine process (counted by the bridge's `restarts`).
    """

    def __init__(self) -> None:
        self.prompt: tuple[str, int | None] | None = None
        self.params: dict[str, Any] = {}
        self._prompt_due = False
        self._params_due: dict[str, Any] = {}
        self._engine: int | None = None  # the bridge's restart count when we last synced

    def set_prompt(self, text: str, transition_chunks: int | None = None) -> None:
        """Record a prompt to send; a bad one raises ValueError here, so nothing unsendable is kept
        (it would fail every later `sync`, inside a host's frame loop)."""
        self.prompt = prompt_request(text, transition_chunks)
        self._prompt_due = True

    def set_params(self, **params: Any) -> None:
        self.params.update(params)
        self._params_due.update(params)

    def new_bridge(self) -> None:
        """The host replaced its bridge (whose restart count starts again): send everything on the next sync."""
        self._engine = None

    def sync(self, bridge: Any) -> bool:
        """Send what is due; returns True when something was sent."""
        status = bridge.status()
        if status.state != "running":
            return False
        prompt_due, params_due = self._prompt_due, self._params_due
        new_engine = status.restarts != self._engine
        if new_engine:  # a fresh process knows nothing yet: send everything, prompt without a blend
            self._engine = status.restarts
            prompt_due, params_due = self.prompt is not None, dict(self.params)
        if prompt_due and self.prompt is not None:
            text, chunks = self.prompt
            bridge.set_prompt(text, transition_chunks=0 if new_engine else chunks)
        if params_due:
            bridge.set_params(**params_due)
        self._prompt_due, self._params_due = False, {}
        return bool(prompt_due and self.prompt is not None) or bool(params_due)
