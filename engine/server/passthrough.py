"""A session that returns its input unchanged: `loom serve --passthrough`.

It implements `engine.session_api.EngineSession` as `engine.stream.session.StreamSession` does, so
the server, the bridge, the transports and the supervisor are tested end to end with exact content
and without a model, and a user can measure the bridge's own latency. Its parameter checks follow
the real session's contract (the live-parameter schema: unknown keys and bad values raise
ValueError) so error paths are exercised too. It counts the prompts it is sent, so a test can see
that a fresh engine is told the host's prompt exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from loom_live.host_bridge.wire.params import LIVE, check_prompt_request


class PassthroughSession:
    """Output frame i is input frame i, at once; prompts and parameters are only recorded."""

    raw_passthrough = True  # the server may copy slot to slot without reading frames at all
    accepts_device_frames = False  # numpy frames (a cuda-ipc ring to ring copy needs no frames at all)
    unfinished = 0  # every output is returned by the push that brought its input

    def __init__(self) -> None:
        self.reset()
        self.prompt = ""
        self.prompts_received = 0
        self.params: dict[str, Any] = {}
        # VACE input is recorded (the wiring is what this session checks): control frames given and their
        # pixel sum, frames that came without one once a host gave them, the reference image's size and sum
        self.control = {"frames": 0, "missing": 0, "sum": 0, "reference": None, "reference_sum": 0}

    def push(self, frames: np.ndarray, control: np.ndarray | None = None) -> np.ndarray:
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise ValueError(f"frames: {frames.dtype} {frames.shape}; expected uint8 [N, H, W, 3]")
        if control is not None:
            self.control["frames"] += len(control)
            self.control["sum"] += int(np.asarray(control, np.int64).sum())
        elif self.control["frames"]:
            self.control["missing"] += len(frames)
        self.frames_in += len(frames)
        self.frames_out += len(frames)
        return frames.copy()

    def poll(self, wait: bool = False) -> np.ndarray:
        return np.zeros((0, 1, 1, 3), np.uint8)

    def flush(self) -> np.ndarray:
        return np.zeros((0, 1, 1, 3), np.uint8)

    def while_waiting(self, fn: Callable[[], None] | None) -> None:
        """Nothing here waits: `fn` is never called."""

    def set_prompt(self, text: str, transition_chunks: int | None = None) -> None:
        self.prompt, _ = check_prompt_request(text, transition_chunks)
        self.prompts_received += 1

    def set_params(self, **params: Any) -> None:
        self.params.update(LIVE.check(params))

    def set_reference(self, image: np.ndarray | None) -> None:
        self.control["reference"] = None if image is None else list(image.shape)
        self.control["reference_sum"] = 0 if image is None else int(np.asarray(image, np.int64).sum())

    def reset(self) -> None:
        self.frames_in = 0
        self.frames_out = 0

    def stats(self) -> dict[str, Any]:
        return {"mode": "passthrough", "frames_in": self.frames_in, "frames_out": self.frames_out,
                "prompt": self.prompt, "prompts_received": self.prompts_received, "params": dict(self.params),
                "control": dict(self.control)}

    def close(self) -> None:
        """Nothing to release: no device memory, no threads."""
