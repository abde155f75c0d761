"""Which of the model's styles a prompt landed on, and how near, told to the person at the controls.

The embedded model knows a fixed set of styles and maps any free text to the nearest one
(engine/stream/style_text.py); a person typing "a goat in charcoal" must see that it became
"pencil sketch", and when a prompt is far from every style or holds no word the table knows.
The engine reports it in its session stats (`prompt_style`, with the `prompt` it belongs to); a
model without a style table (the Wan presets) reports none, and nothing is said.
"""

from __future__ import annotations

from typing import Any

NEAR = 0.5  # cosine similarity from which a prompt names its style rather than merely landing nearest


def reported_style(engine_report: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(prompt, its style match) from the engine's report, or None (no session yet, or no style table)."""
    session = engine_report.get("session") or {}
    match, prompt = session.get("prompt_style"), session.get("prompt")
    if not isinstance(match, dict) or not isinstance(prompt, str) or "style" not in match:
        return None
    return prompt, match


def style_name(name: Any) -> str:
    """A style's name as a person writes it (`pencil_sketch` -> `pencil sketch`)."""
    return str(name).replace("_", " ")


def style_line(prompt: str, match: dict[str, Any]) -> str:
    """`style: "ink on rice paper" -> ink wash (similarity 0.81; next: pencil sketch)`."""
    head = f'style: "{prompt}" -> {style_name(match["style"])}'
    if not match.get("known_words"):
        return f"{head} (no word of the prompt is in the style table: the default nearest style)"
    similarity = float(match.get("similarity", 0.0))
    far = "" if similarity >= NEAR else ", far from every style"
    return f"{head} (similarity {similarity:.2f}{far}; next: {style_name(match.get('runner_up', '?'))})"


def short_style(match: dict[str, Any]) -> str:
    """For the status line and the overlay: `style ink wash 0.81`."""
    return f"style {style_name(match['style'])} {float(match.get('similarity', 0.0)):.2f}"


class StyleReport:
    """Says the style once per prompt, when the engine reports the prompt the host asked for as the one
    in use (until then the engine still reports the prompt it ran with before)."""

    def __init__(self) -> None:
        self.current: dict[str, Any] | None = None
        self._said: tuple[str, str] | None = None

    def update(self, engine_report: dict[str, Any], wanted: str | None = None) -> str | None:
        """A line to print when the report shows a prompt (or style) not said yet, else None; with
        `wanted`, only once the engine runs that prompt."""
        found = reported_style(engine_report)
        if found is None:
            return None
        prompt, match = found
        if wanted is not None and prompt != wanted.strip():
            return None
        self.current = match
        key = (prompt, str(match["style"]))
        if key == self._said:
            return None
        self._said = key
        return style_line(prompt, match)

    @property
    def short(self) -> str:
        return short_style(self.current) if self.current is not None else ""
