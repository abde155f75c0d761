"""Flow-matching Euler schedule with a resolution-dependent (dynamic) shift.

The edit model predicts the velocity v = noise - x0 at noise level sigma; an Euler step moves
x by (sigma_next - sigma) * v. Sigmas start evenly spaced from 1 to 1/steps and are shifted
toward noise by mu, which grows linearly with the number of 2x2 latent patches: larger images
spend more of the schedule at high noise. With one step the only sigma is 1, which any shift
keeps at 1, so the step is x0 = noise - v.
"""

from __future__ import annotations

import math

import torch

TRAIN_TIMESTEPS = 1000
BASE_SEQ, MAX_SEQ = 256, 4096
BASE_SHIFT, MAX_SHIFT = 0.5, 1.16


def dynamic_shift(latent_h: int, latent_w: int) -> float:
    """mu for a target latent of this size (sequence = latent patches of 2x2)."""
    seq = latent_h * latent_w // 4
    slope = (MAX_SHIFT - BASE_SHIFT) / (MAX_SEQ - BASE_SEQ)
    return BASE_SHIFT + slope * (seq - BASE_SEQ)


def shifted_sigmas(steps: int, mu: float) -> list[float]:
    """steps + 1 sigmas, from the first (shifted) noise level down to 0."""
    if steps < 1:
        raise ValueError(f"steps: {steps} must be at least 1")
    raw = [1.0 - i * (1.0 - 1.0 / steps) / max(steps - 1, 1) for i in range(steps)]
    shifted = [math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0)) for s in raw]
    return shifted + [0.0]


class EulerFlowSchedule:
    """The fixed sigmas of one run; `timesteps` are what the UNet is given (sigma * 1000)."""

    def __init__(self, steps: int, latent_h: int, latent_w: int) -> None:
        self.sigmas = shifted_sigmas(steps, dynamic_shift(latent_h, latent_w))

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1

    def timestep(self, i: int) -> float:
        return self.sigmas[i] * TRAIN_TIMESTEPS

    def step(self, i: int, x: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
        return x + (self.sigmas[i + 1] - self.sigmas[i]) * velocity
