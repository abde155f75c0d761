"""Flow-matching timesteps for few-step streaming denoising.

The Wan2.1 causal generators were distilled on a flow-matching schedule with 1000 training
steps and a sigma shift of 8: a user-facing step index t in [0, 1000) maps to
sigma = shift * s / (1 + (shift - 1) * s) with s = t / 1000, and the model is conditioned on
1000 * sigma. The model predicts the flow v = eps - x0, so x0 = x_t - sigma * v, and the next,
lower step re-noises x0 with fresh noise: x = (1 - sigma) * x0 + sigma * eps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom_live.host_bridge.wire.params import TRAIN_TIMESTEPS


@dataclass(frozen=True)
class FlowSchedule:
    """Maps step indices to sigmas and model timesteps; stateless."""

    shift: float = 8.0
    train_timesteps: int = TRAIN_TIMESTEPS

    def sigma(self, step: float | torch.Tensor) -> float | torch.Tensor:
        """Sigma (noise fraction, 0..1) of a step index in [0, train_timesteps).

        Accepts a device tensor too, so a step computed on the GPU never syncs the host.
        """
        if not isinstance(step, torch.Tensor) and not 0 <= step < self.train_timesteps:
            raise ValueError(f"step index {step} is outside [0, {self.train_timesteps})")
        s = step / self.train_timesteps
        return self.shift * s / (1.0 + (self.shift - 1.0) * s)

    def model_timestep(self, step: float | torch.Tensor) -> float | torch.Tensor:
        """The timestep the DiT is conditioned on for a step index."""
        return self.sigma(step) * self.train_timesteps

    @staticmethod
    def to_x0(x_t: torch.Tensor, flow: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
        """Clean estimate from a noisy latent and the predicted flow."""
        return x_t - _bcast(sigma, x_t) * flow

    @staticmethod
    def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor | float) -> torch.Tensor:
        """Noisy latent at `sigma` on the straight path from x0 to the noise."""
        s = _bcast(sigma, x0)
        return (1.0 - s) * x0 + s * noise


def _bcast(sigma: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
    """Per-row sigmas [B] broadcast over [B, C, F, H, W]."""
    if isinstance(sigma, torch.Tensor) and sigma.dim() == 1:
        return sigma.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))
    return sigma
