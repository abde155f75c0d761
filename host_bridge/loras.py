"""Style LoRAs as a host hands them to an engine it launches: checked first, then `--lora` arguments.

A host (the TouchDesigner operator, the ComfyUI nodes) lets its user pick LoRA files and scales.
What the host can tell without torch is checked here, before an engine loads for nothing: the file
exists, the scale is allowed, and each LoRA's name (its file name without the extension, what
`lora_scales` addresses) is short enough and not taken by another. Whether a file fits the model
(a LoRA for the 14B model given to the 1.3B one) only the engine can tell: it refuses such a file
with a message that begins with the file's path, so `refused_lora` finds the file an engine's
failure names, and the host can start again without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from loom_live.host_bridge.wire.params import LORA_SCALES, NAME_LEN, lora_name

WORDS_KEPT = 300  # characters of an engine's refusal a host shows


@dataclass(frozen=True)
class LoraChoice:
    """One LoRA a host asks an engine to load: its absolute path (the engine's working directory may
    differ from the host's) and its scale at load."""

    path: str
    scale: float

    @property
    def name(self) -> str:
        return lora_name(self.path)

    def engine_arg(self) -> str:
        """`PATH:SCALE` as `loom serve --lora` reads it (the scale after the last colon, so a Windows
        drive letter stays part of the path)."""
        return f"{self.path}:{self.scale!r}"


def lora_choice(path: str, scale: float) -> LoraChoice:
    """A LoRA file and scale checked as far as a host can; ValueError saying what is wrong."""
    text = str(path).strip()
    if not text:
        raise ValueError("no LoRA file given")
    try:  # a path the OS cannot look at (too long, unreadable folder, offline share, ~nobody) is a bad path too
        file = Path(text).expanduser()
        if not file.exists():
            raise ValueError(f"{file}: no such file")
        if not (file.is_file() or file.is_dir()):
            raise ValueError(f"{file}: not a file; expected a LoRA .safetensors (or .pt) file")
        file = file.resolve()
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{text}: cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if len(lora_name(str(file))) > NAME_LEN:
        raise ValueError(f"{file.name}: the file name is longer than {NAME_LEN} characters, the longest name live "
                         "controls take; rename the file")
    problem = LORA_SCALES.problem({lora_name(str(file)): scale})
    if problem is not None:
        raise ValueError(problem)
    return LoraChoice(str(file), float(scale))


def check_together(choices: Iterable[LoraChoice]) -> None:
    """ValueError when the LoRAs cannot be loaded together: two share a name, or there are too many."""
    by_name: dict[str, str] = {}
    for c in choices:
        if c.name in by_name:
            raise ValueError(f"{c.path} and {by_name[c.name]} are both named {c.name!r} (the file name without its "
                             "extension, what live scale changes address); rename one of them")
        by_name[c.name] = c.path
    if len(by_name) > (LORA_SCALES.max_len or 0):
        raise ValueError(f"{len(by_name)} LoRAs; an engine loads at most {LORA_SCALES.max_len}")


def engine_args(choices: Iterable[LoraChoice]) -> list[str]:
    """The `loom serve` arguments that load these LoRAs at their scales."""
    return [arg for c in choices for arg in ("--lora", c.engine_arg())]


def scales(choices: Iterable[LoraChoice]) -> dict[str, float]:
    """The `lora_scales` live parameter for these LoRAs."""
    return {c.name: c.scale for c in choices}


def refused_lora(failure: str, choices: Iterable[LoraChoice]) -> tuple[LoraChoice, str] | None:
    """The LoRA an engine's failure text names, with the engine's words from the path on; None if none.

    The engine's LoRA errors (a file that is missing, unreadable, or for another model) begin with the
    file's path, and the host passed absolute paths, so the path is found as it was given."""
    named = [c for c in choices if c.path in failure]
    if not named:
        return None
    choice = max(named, key=lambda c: len(c.path))  # /x/ink.safetensors.bak names that one, not /x/ink.safetensors
    words = failure[failure.index(choice.path):].splitlines()[0]
    return choice, words[:WORDS_KEPT]


__all__ = ["LoraChoice", "check_together", "engine_args", "lora_choice", "refused_lora", "scales"]
