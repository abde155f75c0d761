"""What the host wants the engine to use: the newest prompt and live parameters, remembered once.

The bridge is the only owner: a host calls `Bridge.set_prompt` / `set_params` whenever its user
changes something, whether or not an engine runs. A running engine is told at once; an engine that
starts or restarts later (a fresh process knows nothing) is told everything here exactly once, when
it becomes ready. The bridge checks values against the live-parameter schema before they are
remembered, so nothing unsendable is kept to fail every later engine.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loom_live.host_bridge.wire.params import LIVE


@dataclass(frozen=True)
class PromptWish:
    """A prompt and the chunks over which a running engine blends into it (None: the engine's own default)."""

    text: str
    transition_chunks: int | None = None


@dataclass
class Wanted:
    """The host's prompt and parameters. Not locked itself: the bridge reads and writes it under its
    engine lock, in the same hold as it sends, so a change and a fresh engine's catch-up never both
    deliver one value."""

    prompt: PromptWish | None = None
    params: dict[str, Any] = field(default_factory=dict)
    # VACE: the reference image (uint8 RGB top-down; None: none asked for), and whether one was ever
    # set or cleared (a fresh engine is told only then: else the config's own reference stands)
    reference: Any = None
    reference_set: bool = False

    def want_prompt(self, wish: PromptWish) -> Callable[[], None]:
        """Remember a prompt (checked by the caller); returns what undoes it (the engine refused it)."""
        before, self.prompt = self.prompt, wish

        def undo() -> None:
            self.prompt = before
        return undo

    def want_params(self, params: dict[str, Any]) -> Callable[[], None]:
        """Remember parameters (checked by the caller, `LIVE.check`); returns what undoes them. A mapping
        (LoRA scales by name) adds to what was wanted; the sum is checked again, since a fresh engine is
        told it in one message: ValueError, nothing remembered, when it no longer fits."""
        before = copy.deepcopy(self.params)
        merged = []
        for key, value in params.items():
            old = self.params.get(key)
            if isinstance(value, dict) and isinstance(old, dict):
                self.params[key] = {**old, **value}
                merged.append(key)
            else:
                self.params[key] = value
        problem = LIVE.problem({key: self.params[key] for key in merged})
        if problem is not None:
            self.params = before
            raise ValueError(f"{problem} (counting those set before, which an engine that starts later is told "
                             "together)")

        def undo() -> None:
            self.params = before
        return undo

    def want_reference(self, image: Any) -> Callable[[], None]:
        """Remember a reference image (checked and converted by the caller) or None; returns its undo."""
        before = (self.reference, self.reference_set)
        self.reference, self.reference_set = image, True

        def undo() -> None:
            self.reference, self.reference_set = before
        return undo

    def for_fresh_engine(self) -> list[tuple[str, dict[str, Any], list[bytes]]]:
        """The control messages (type, fields, payload) that tell a fresh engine everything; the prompt
        without a blend, so its first frames already have the host's style rather than the config's."""
        out: list[tuple[str, dict[str, Any], list[bytes]]] = []
        if self.prompt is not None:
            out.append(("prompt", {"text": self.prompt.text, "transition_chunks": 0}, []))
        if self.params:
            out.append(("params", {"params": dict(self.params)}, []))
        if self.reference_set and self.reference is None:
            out.append(("reference", {"clear": True}, []))
        elif self.reference_set:
            h, w = self.reference.shape[:2]
            out.append(("reference", {"width": w, "height": h}, [self.reference.tobytes()]))
        return out

    def snapshot(self) -> Wanted:
        """A copy a host may keep and change without touching what the bridge remembers (the reference
        image is shared: it is never written to)."""
        return Wanted(self.prompt, copy.deepcopy(self.params), self.reference, self.reference_set)
