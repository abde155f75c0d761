"""The player's style line: which of the model's styles a prompt landed on, said once per prompt."""

from __future__ import annotations

import io

import torch

from loom_live.engine.stream.prompts import HashTextEncoder, PromptConditioner
from loom_live.plugin.player.status import StatusPrinter, live_line
from loom_live.plugin.player.style_line import StyleReport, style_line


def _report(prompt: str, style: str | None, similarity: float = 0.8, known: int = 3) -> dict:
    match = None if style is None else {"style": style, "similarity": similarity, "runner_up": "ink wash",
                                        "known_words": known}
    return {"pid": 1, "session": {"prompt": prompt, "prompt_style": match}}


def test_the_style_is_said_once_per_prompt_and_again_when_the_prompt_changes():
    report = StyleReport()
    assert report.update({}) is None  # no session yet
    first = report.update(_report("charcoal goat", "pencil sketch", 0.71))
    assert first == 'style: "charcoal goat" -> pencil sketch (similarity 0.71; next: ink wash)'
    assert report.update(_report("charcoal goat", "pencil sketch", 0.71)) is None
    assert report.short == "style pencil sketch 0.71"
    assert "-> thermal camera" in report.update(_report("heat vision", "thermal camera"))
    assert "-> pencil sketch" in report.update(_report("charcoal goat", "pencil_sketch"))  # back again: said again


def test_the_style_waits_for_the_prompt_the_host_asked_for():
    report = StyleReport()
    assert report.update(_report("pencil sketch", "pencil_sketch", 1.0), wanted="heat vision") is None
    assert report.short == ""  # the engine still runs its start-up prompt
    line = report.update(_report("heat vision", "thermal_camera"), wanted=" heat vision ")
    assert line.startswith('style: "heat vision" -> thermal camera (similarity 0.80; next: ink wash)')


def test_a_far_or_unknown_prompt_is_said_to_be_so():
    assert "far from every style" in style_line("a dog", {"style": "watercolour", "similarity": 0.21,
                                                          "runner_up": "oil painting", "known_words": 2})
    line = style_line("qwzx", {"style": "pencil sketch", "similarity": 0.0, "runner_up": "ink wash", "known_words": 0})
    assert "no word of the prompt is in the style table" in line


def test_a_model_without_a_style_table_says_nothing():
    """The Wan presets' text encoders (here the hash stand-in) say no style: the session reports None."""
    conditioner = PromptConditioner(HashTextEncoder(8, 4), "ink wash", device=torch.device("cpu"),
                                    dtype=torch.float32)
    try:
        assert conditioner.match is None
    finally:
        conditioner.close()
    report = StyleReport()
    assert report.update(_report("ink wash", None)) is None
    assert report.update({"session": {"mode": "passthrough", "prompt": "ink wash"}}) is None
    assert report.short == ""


def test_the_style_reaches_the_status_line_and_the_file_progress_line():
    class Status:
        state, fps, latency_ms, dropped, message = "running", 9.5, 300.0, 2, ""

    assert live_line(10, Status(), style="style ink wash 0.81").endswith("engine running  style ink wash 0.81")
    assert "style" not in live_line(10, Status())
    out = io.StringIO()  # not a terminal: plain progress lines
    printer = StatusPrinter(out)
    printer.set_postfix("style ink wash 0.81")
    printer.progress(1, 2)
    printer.progress(2, 2)
    assert "style ink wash 0.81" in out.getvalue().splitlines()[-1]
