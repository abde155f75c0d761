"""The player's start-up stage lines: each says how long it took, and a long one keeps saying it is alive."""

from __future__ import annotations

import io
import re
import time

from loom_live.plugin.player import status
from loom_live.plugin.player.status import StatusPrinter


def test_stage_lines_say_how_long_each_stage_took_and_a_long_stage_has_a_heartbeat(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(status.time, "monotonic", lambda: clock[0])
    out = io.StringIO()
    printer = StatusPrinter(out)
    printer.stage("loom play: starting the engine: launching the engine")
    clock[0] += 0.4
    printer.stage("loom play: starting the engine: loading the model")
    for _ in range(24):  # polled every half second while the model loads, 12 s
        clock[0] += 0.5
        printer.stage("loom play: starting the engine: loading the model")
    printer.end_stage()
    printer.end_stage()  # nothing under way: nothing said
    assert out.getvalue().splitlines() == [
        "loom play: starting the engine: launching the engine ...",
        "loom play: starting the engine: launching the engine: 0.4 s",
        "loom play: starting the engine: loading the model ...",
        "loom play: starting the engine: loading the model ... 5 s so far",
        "loom play: starting the engine: loading the model ... 10 s so far",
        "loom play: starting the engine: loading the model: 12.0 s",
    ]
    assert not re.search(r"\(0 s\)", out.getvalue())


def test_the_wait_for_a_files_first_frame_has_a_heartbeat_that_ends_with_the_first_frame(monkeypatch):
    """After the engine is ready a file's first restyled frame may still take minutes (a compile at a new
    size): the terminal says it is waiting, again every few seconds, and stops saying so at that frame."""
    monkeypatch.setattr(status, "STAGE_HEARTBEAT_S", 0.02)
    out = io.StringIO()
    printer = StatusPrinter(out)
    printer.await_first("loom play: waiting for the first restyled frame")
    deadline = time.monotonic() + 10
    while out.getvalue().count("so far") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    printer.progress(1, 2)  # joins the heartbeat: nothing of it comes after
    said = out.getvalue()
    time.sleep(0.1)
    assert out.getvalue() == said and said.count("so far") >= 2
    lines = said.splitlines()
    assert lines[0] == "loom play: waiting for the first restyled frame ..."
    beat = r"loom play: waiting for the first restyled frame \.\.\. \d+ s so far"
    assert all(re.fullmatch(beat, line) for line in lines[1:])
    printer.end_progress()


class _GoneTerminal(io.StringIO):
    """A terminal whose window was closed (or whose SSH session dropped): every write fails with EIO."""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(5, "Input/output error")


def test_a_terminal_that_went_away_silences_the_printer_instead_of_ending_the_run():
    """SIGHUP from a closed terminal must end the run with its outputs finalised and exit 129: the status
    lines written meanwhile (the live line, the final report) must not raise out of the run."""
    printer = StatusPrinter(_GoneTerminal())
    printer.update("live      3 frames", force=True)
    printer.say("loom play: input lost")
    printer.progress(1, 2)
    printer.say("loom play: said above the bar")
    printer.end_progress(final_total=2)
    printer.quiet = False  # what run_player does for an error line
    printer.finish("loom play: stopped by SIGHUP; 3 frames to set.mp4")
    assert printer.quiet
