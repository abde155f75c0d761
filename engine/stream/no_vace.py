"""What a session does with VACE input when its model has no VACE control blocks (the plain Wan DiT,
the edit family, the GPU pipeline): the frames go on, the control frames are counted and left out, a
reference image is refused in one line. One helper, so every such family answers alike."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class NoStructureControl:
    """A session's answer to VACE input when its model has no control blocks: host control frames are
    counted and left out, once said in the log (the frames go on); a reference image is refused in one line."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.refused_frames = 0

    def take(self, control: Any) -> None:
        if control is None:
            return
        if not self.refused_frames:
            log.warning("control frames left out: %s has no VACE control blocks (use a *vace* model preset)",
                        self.model)
        self.refused_frames += len(control)

    def reference(self, image: Any) -> None:
        raise ValueError(f"reference image: {self.model} has no VACE control blocks and takes none; use a *vace* "
                         "model preset")
