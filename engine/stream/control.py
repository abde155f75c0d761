"""The control side of a VACE stream: per chunk, control frames and their latents; per stream, the
reference entry. The session owns one and calls it at the stream's start and for each chunk's encode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from loom_live.engine.config import ControlConfig, LoomConfig
from loom_live.engine.models.wan_vace import reference_entry
from loom_live.engine.stream.control_frames import ControlFrames
from loom_live.engine.stream.control_latents import ControlEncoder, EncodeRunner


class VaceControl:
    """Control frames (engine/stream/control_frames.py) -> control latents (control_latents.py), with the
    live source and scale of the config's `control` section, and the reference image as a pinned entry."""

    def __init__(self, cfg: LoomConfig, models: Any, mapper: Any, layout: torch.memory_format,
                 run: EncodeRunner) -> None:
        self.cfg = cfg.control
        self.mapper = mapper
        self.frames = ControlFrames(models.device, self.cfg.depth_model, self.cfg.video,
                                    fused=cfg.model.fuse_elementwise)
        self.encoder = ControlEncoder(models.encoder, layout, run)
        self.reference = read_image(self.cfg.reference) if self.cfg.reference else None
        self.reference_from = self.cfg.reference  # what the stats show: the file, or a host's image

    def configure(self, cfg: ControlConfig) -> None:
        """New live settings (source, scale), already validated by the config's rules."""
        self.cfg = cfg

    def start(self, denoiser: Any) -> None:
        """A new stream: control state afresh, the scale set, the reference committed and pinned."""
        self.frames.reset()
        self.encoder.reset()
        denoiser.set_context_scale(self.cfg.context_scale)
        if self.reference is not None:
            denoiser.add_reference(*self._reference_entry())

    def set_reference(self, image: np.ndarray | None) -> None:
        """A host's new reference image (uint8 RGB [H, W, 3] or [1, H, W, 3]) or None; swapped in by
        `swap_reference` at the next chunk. ValueError names an image it cannot take."""
        if image is None:
            self.reference, self.reference_from = None, None
            return
        from loom_live.engine.stream.frames import FrameError, validate_frames

        image = np.asarray(image)
        try:
            good, dropped = validate_frames(image[None] if image.ndim == 3 else image)
        except FrameError as exc:
            raise ValueError(f"reference image: {exc}") from None
        if dropped or len(good) != 1:
            raise ValueError(f"reference image: {tuple(image.shape)}; expected one uint8 RGB image [H, W, 3]")
        self.reference = np.ascontiguousarray(good)
        self.reference_from = f"a host's image ({good.shape[2]}x{good.shape[1]})"

    def swap_reference(self, denoiser: Any) -> None:
        """Put the current reference (or none) in place of the stream's pinned first entry, mid-stream."""
        denoiser.replace_reference(*(self._reference_entry() if self.reference is not None else (None, None)))

    def _reference_entry(self) -> tuple[torch.Tensor, torch.Tensor]:
        latent = self.encoder.reference(self.mapper.to_model(self.reference))
        return reference_entry(latent)

    def latents(self, x: torch.Tensor, given: np.ndarray | torch.Tensor | None) -> torch.Tensor:
        """Control latents [1, 96, f, h, w] for a chunk's model-size frames x (and the host's control frames)."""
        return self.encoder.latents(self._frames(x, given))

    def pixels(self, x: torch.Tensor, given: np.ndarray | torch.Tensor | None) -> torch.Tensor:
        """The chunk's control video as VAE input [1, 3, N, H, W], for a caller that encodes it batched
        with the input video and hands the reactive latents to `assemble`."""
        return self.encoder.pixels(self._frames(x, given))

    def assemble(self, reactive: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        return self.encoder.assemble(reactive, pixels)

    def _frames(self, x: torch.Tensor, given: np.ndarray | torch.Tensor | None) -> torch.Tensor:
        given_x = self.mapper.to_model(given) if given is not None else None
        return self.frames.make(self.cfg.control_source, x, given_x)

    def stats(self) -> dict[str, Any]:
        return {"source": self.cfg.control_source, "context_scale": self.cfg.context_scale,
                "refused_frames": self.frames.refused, "missing_frames": self.frames.missing,
                "reference": self.reference_from, "grey_latents": self.encoder.inactive.stats()}


def read_image(path: str) -> np.ndarray:
    """An image file as uint8 RGB [1, H, W, 3]; ValueError naming the file when it cannot be read."""
    bgr = cv2.imread(str(Path(path).expanduser()), cv2.IMREAD_COLOR)
    if bgr is None:
        raise ValueError(f"control.reference: {path} cannot be read as an image (PNG, JPEG, ...)")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)[None]
