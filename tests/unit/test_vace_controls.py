"""The player's, OSC's and the web page's VACE controls: the control scale and source from the one
live-parameter schema (ranges, choices), refused in words and counted when bad, or when the run cannot
make a source or has no VACE model; a reference image file read and sent live."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from loom_live.engine.config import load_config
from loom_live.host_bridge.wire.params import CONTEXT_SCALE, CONTROL
from loom_live.plugin.cli.play import available_sources
from loom_live.plugin.player.controls import Command, ControlError, Controls, ControlState, KeyboardInput
from loom_live.plugin.player.osc import OSC_ADDRESSES, command_for
from loom_live.plugin.web import page_controls


class RecordingBridge:
    def __init__(self) -> None:
        self.params: list[dict] = []
        self.references: list = []

    def set_params(self, **params) -> None:
        self.params.append(params)

    def set_prompt(self, text, transition_chunks=None) -> None:
        pass

    def set_reference(self, image) -> None:
        if image is not None and image.ndim != 3:
            raise ValueError("reference image: not an image")
        self.references.append(image)


def vace_controls(sources=("edges", "grey", "flow")) -> Controls:
    return Controls(ControlState(prompts=["ink"], control_sources=tuple(sources)))


def test_keys_step_the_control_scale_and_cycle_the_sources_this_run_can_make():
    controls, bridge = vace_controls(), RecordingBridge()
    keys = KeyboardInput(controls)
    for key in "==-c":
        keys.press(ord(key))
    controls.apply_pending(bridge)
    assert bridge.params == [{"context_scale": 1.05, "control_source": "grey"}]  # one update per setting
    for key in "cc":
        keys.press(ord(key))
    controls.apply_pending(bridge)
    assert bridge.params[-1] == {"control_source": "edges"}  # round: grey -> flow -> edges
    for _ in range(60):
        keys.press(ord("="))
    controls.apply_pending(bridge)
    assert bridge.params[-1] == {"context_scale": CONTEXT_SCALE.max}  # keys stop at the schema's range


def test_osc_addresses_set_scale_and_source_and_bad_values_are_refused_in_words():
    assert command_for("/loom/control/scale", (0.25,)) == Command("context_scale", (0.25,))
    assert command_for("/loom/control/source", ("flow",)) == Command("control_source", ("flow",))
    assert command_for("/loom/control/next", ()) == Command("control_next")
    assert command_for("/loom/reference", ("look.png",)) == Command("reference", ("look.png",))
    for address, args, why in [("/loom/control/scale", (3.0,), r"context_scale: .*\[0, 2\]"),
                               ("/loom/control/scale", ("lots",), "not a number"),
                               ("/loom/control/source", ("scribble",), "one of 'edges', 'grey', 'flow'"),
                               ("/loom/reference", ("  ",), "an image file path")]:
        with pytest.raises(ControlError, match=why):
            command_for(address, args)
    assert {"/loom/control/scale", "/loom/control/source", "/loom/reference"} <= set(OSC_ADDRESSES)


def test_a_source_the_run_cannot_make_or_a_model_without_vace_is_refused_and_counted():
    controls, bridge = vace_controls(), RecordingBridge()
    controls.put(command_for("/loom/control/source", ("depth",)))
    controls.apply_pending(bridge)
    assert bridge.params == [] and controls.state.refused == 1
    assert "'depth' is not available in this run" in controls.state.message
    plain = Controls(ControlState(prompts=["ink"]))
    for command in (Command("context_scale", (0.5,)), Command("control_next"), Command("reference", ("x.png",))):
        plain.put(command)
    plain.apply_pending(bridge)
    assert bridge.params == [] and bridge.references == [] and plain.state.refused == 3
    assert "no VACE control blocks" in plain.state.message


def test_the_page_reads_scale_and_sources_off_the_schema_and_sends_the_same_commands():
    schema = page_controls.schema()
    assert (schema["context_scale"]["min"], schema["context_scale"]["max"]) == (CONTEXT_SCALE.min, CONTEXT_SCALE.max)
    assert schema["control_source"] == list(CONTROL.choices)
    assert page_controls.command_for({"control": "context_scale", "value": 0.5}) == Command("context_scale", (0.5,))
    with pytest.raises(ControlError, match=r"\[0, 2\]"):
        page_controls.command_for({"control": "context_scale", "value": 9})
    state = page_controls.control_state(ControlState(prompts=["ink"], control_sources=("edges", "grey")))
    assert state["control_sources"] == ["edges", "grey"] and state["context_scale"] == CONTEXT_SCALE.default


def test_a_reference_file_is_read_and_sent_and_an_unreadable_one_keeps_the_old(tmp_path):
    path = tmp_path / "look.png"
    cv2.imwrite(str(path), np.full((6, 4, 3), (10, 20, 30), np.uint8))  # BGR on disk
    controls, bridge = vace_controls(), RecordingBridge()
    controls.put(command_for("/loom/reference", (str(path),)))
    controls.apply_pending(bridge)
    assert len(bridge.references) == 1 and bridge.references[0][0, 0].tolist() == [30, 20, 10]
    assert controls.state.reference == str(path) and controls.state.message == f"reference: {path}"
    controls.put(command_for("/loom/reference", (str(tmp_path / "missing.png"),)))
    lines = controls.apply_pending(bridge)
    assert len(bridge.references) == 1 and controls.state.refused == 1 and "cannot be read" in lines[-1]
    controls.put(command_for("/loom/reference", ()))
    controls.apply_pending(bridge)
    assert bridge.references[-1] is None and controls.state.reference is None


def test_the_sources_a_run_offers_follow_its_config(tmp_path):
    assert available_sources(load_config("tiny-random")) == ()
    assert available_sources(load_config("tiny-vace")) == ("edges", "grey", "flow")
    video = load_config("tiny-vace", ["control.control_source=video", f"control.video={tmp_path / 'c.mp4'}"])
    assert available_sources(video) == ("edges", "grey", "flow", "video")
