"""A stand-in for the host bridge that the player's controls drive (`Controls.apply_pending`, `take_start`): it
records what they hand over, so a test sees each update sent once, or nothing sent at all."""

from __future__ import annotations

from typing import Any


class RecordingBridge:
    """Each `set_params` and `set_prompt` call, in order."""

    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = []
        self.prompts: list[tuple[str, int | None]] = []

    def set_params(self, **params: Any) -> None:
        self.params.append(params)

    def set_prompt(self, text: str, transition_chunks: int | None = None) -> None:
        self.prompts.append((text, transition_chunks))
