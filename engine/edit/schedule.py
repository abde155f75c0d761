"""Flow-matching Euler schedule with a resolution-dependent (dynamic) shift.

The edit model predicts the velocity v = noise - x0 at noise level sigma; an Euler step moves
x by (sigma_next - sigma) * v. Sigmas start evenly spaced from 1 to 1/steps and are shifted
toward noise by mu, which grows linearly with the number of 2x2 latent patches: larger images
spend more of the schedule at high noise. With one step the only sigma is 1, which any shift
keeps at 1, so the step is x0 = noise - v.

The shift's line comes from the checkpoint's `scheduler/scheduler_config.json` when it has one,
with DreamLiteMobilePipeline's defaults for what it leaves out (the values below).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class ShiftLine:
    """mu grows linearly from base_shift at base_seq 2x2 latent patches to max_shift at max_seq."""

    base_seq: int = 256
    max_seq: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.16

    @classmethod
    def from_file(cls, path: str | Path) -> ShiftLine:
        """A FlowMatchEulerDiscreteScheduler config.json (the keys DreamLiteMobilePipeline reads)."""
        try:
            c = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable scheduler config ({exc})") from exc
        d = cls()
        return cls(int(c.get("base_image_seq_len", d.base_seq)), int(c.get("max_image_seq_len", d.max_seq)),
                   float(c.get("base_shift", d.base_shift)), float(c.get("max_shift", d.max_shift)))


def dynamic_shift(latent_h: int, latent_w: int, line: ShiftLine = ShiftLine()) -> float:
    """mu for a target latent of this size (sequence = latent patches of 2x2)."""
    seq = latent_h * latent_w // 4
    slope = (line.max_shift - line.base_shift) / (line.max_seq - line.base_seq)
    return line.base_shift + slope * (seq - line.base_seq)


def shifted_sigmas(steps: int, mu: float) -> list[float]:
    """steps + 1 sigmas, from the first (shifted) noise level down to 0."""
    if steps < 1:
        raise ValueError(f"steps: {steps} must be at least 1")
    raw = [1.0 - i * (1.0 - 1.0 / steps) / max(steps - 1, 1) for i in range(steps)]
    shifted = [math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0)) for s in raw]
    return shifted + [0.0]


class EulerFlowSchedule:
    """The fixed sigmas of one run; `timesteps` are what the UNet is given (sigma * 1000)."""

    def __init__(self, steps: int, latent_h: int, latent_w: int, line: ShiftLine = ShiftLine()) -> None:
        self.sigmas = shifted_sigmas(steps, dynamic_shift(latent_h, latent_w, line))

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1

    def timestep(self, i: int) -> float:
        return self.sigmas[i] * TRAIN_TIMESTEPS

    def step(self, i: int, x: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        return x + (self.sigmas[i + 1] - self.sigmas[i]) * velocity
