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
