"""The player's, OSC's and the web page's VACE controls: the control scale and source from the one
live-parameter schema (ranges, choices), refused in words and counted when bad, or when the run cannot
make a source or has no VACE model; a reference image file read and sent live."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from loom_live.engine.config import load_config
from loom_live.host_bridge.wire.params import CONTEXT_SCALE, CONTROL
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


def test_the_embedded_models_edge_scale_goes_through_and_other_sources_and_a_reference_are_refused():
    """A model that reads its input's edges takes the control scale (its edge scale) and the edges source;
    another source or a reference is refused in words that name what it can take."""
    controls, bridge = Controls(ControlState(prompts=["ink"], control_sources=("edges",), takes_reference=False)), \
        RecordingBridge()
    keys = KeyboardInput(controls)
    for key in "--":
        keys.press(ord(key))
    controls.apply_pending(bridge)
    assert bridge.params == [{"context_scale": 0.9}]
    for command in (Command("control_source", ("grey",)), Command("reference", ("x.png",)),
                    Command("reference_reload")):
        controls.put(command)
        controls.apply_pending(bridge)
        assert "reads its input's edges only" in controls.state.message and "*vace* preset" in controls.state.message
    assert bridge.params == [{"context_scale": 0.9}] and bridge.references == [] and controls.state.refused == 3


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
    assert len(bridge.references) == 1 and controls.state.refused == 1 and "missing.png: no such file" in lines[-1]
    controls.put(command_for("/loom/reference", ()))
    controls.apply_pending(bridge)
    assert bridge.references[-1] is None and controls.state.reference is None


def test_the_sources_a_run_offers_follow_its_config(tmp_path):
    assert load_config("tiny-random").control_sources == ()
    assert load_config("default").control_sources == ("edges",)  # the embedded model reads its input's edges
    assert load_config("tiny-vace").control_sources == ("edges", "grey", "flow")
    video = load_config("tiny-vace", ["control.control_source=video", f"control.video={tmp_path / 'c.mp4'}"])
    assert video.control_sources == ("edges", "grey", "flow", "video")


def test_a_served_engine_s_structure_control_is_what_the_controls_offer():
    """`loom play --endpoint` offered the sources of -c's model: the embedded model's edges alone on a served VACE
    engine, or VACE's on one without them. Once the engine says its own (`take_start`), the keys, OSC and the page
    offer those, video too where this run sends a VACE engine control frames (--control-input); an engine that does
    not say (an older one) leaves -c's."""
    start = {"prompt": "ink", "params": {"control_source": "edges", "context_scale": 1.0},
             "control_sources": ["edges", "grey", "flow"], "takes_reference": True}
    for frames, sources in ((False, ("edges", "grey", "flow")), (True, ("edges", "grey", "flow", "video"))):
        controls, bridge = Controls(ControlState(prompts=["ink"], control_sources=("edges",), takes_reference=False)), \
            RecordingBridge()
        controls.take_start(start, bridge, prompt_given=True, given={}, control_frames=frames)
        assert (controls.state.control_sources, controls.state.takes_reference) == (sources, True)
        for command in (Command("control_next"), Command("reference", (None,))):
            controls.put(command)
        controls.apply_pending(bridge)
        assert bridge.params == [{"control_source": "grey"}] and bridge.references == [None]
        assert controls.state.refused == 0
    edges_only = {**start, "control_sources": ["edges"], "takes_reference": False}
    controls = vace_controls()
    controls.take_start(edges_only, bridge, prompt_given=True, given={}, control_frames=True)
    assert (controls.state.control_sources, controls.state.takes_reference) == (("edges",), False)  # reads no video
    controls.put(Command("reference", (None,)))
    assert "reads its input's edges only" in controls.apply_pending(bridge)[-1] and controls.state.refused == 1
    controls = vace_controls()
    controls.take_start({"prompt": "ink", "params": {}}, bridge, prompt_given=True, given={}, control_frames=True)
    assert (controls.state.control_sources, controls.state.takes_reference) == (("edges", "grey", "flow"), True)


def _png(image_rgb: np.ndarray) -> str:
    import base64

    ok, raw = cv2.imencode(".png", image_rgb[:, :, ::-1])
    assert ok
    return base64.b64encode(raw.tobytes()).decode()


def test_the_r_key_reads_the_reference_file_again_after_it_was_overwritten(tmp_path):
    path = tmp_path / "look.png"
    cv2.imwrite(str(path), np.full((6, 4, 3), 10, np.uint8))
    controls, bridge = Controls(ControlState(prompts=["ink"], control_sources=("edges",), reference=str(path))), \
        RecordingBridge()
    keys = KeyboardInput(controls)
    keys.press(ord("r"))
    controls.apply_pending(bridge)
    cv2.imwrite(str(path), np.full((8, 8, 3), 200, np.uint8))  # the VJ overwrites the file, then presses r
    keys.press(ord("r"))
    lines = controls.apply_pending(bridge)
    assert [r.shape for r in bridge.references] == [(6, 4, 3), (8, 8, 3)] and (bridge.references[-1] == 200).all()
    assert lines == [f"reference: {path}"] and controls.state.refused == 0
    path.write_bytes(b"half a file")  # caught mid-write: refused, the reference in use stays
    keys.press(ord("r"))
    assert "cannot be read as an image" in controls.apply_pending(bridge)[-1] and len(bridge.references) == 2
    for state, words in [(ControlState(prompts=["ink"], control_sources=("edges",)), "no reference file"),
                         (ControlState(prompts=["ink"], reference=str(path)), "no VACE control blocks")]:
        plain = Controls(state)
        KeyboardInput(plain).press(ord("r"))
        assert words in plain.apply_pending(bridge)[-1] and plain.state.refused == 1


def test_a_page_upload_becomes_the_reference_and_bad_ones_are_refused_in_words():
    image = np.random.default_rng(0).integers(0, 256, (9, 7, 3), np.uint8)
    command = page_controls.command_for({"control": "reference", "name": "look.png", "data": _png(image)})
    assert command.name == "reference_image" and np.array_equal(command.args[0].image, image)
    controls, bridge = vace_controls(), RecordingBridge()
    controls.put(command)
    assert controls.apply_pending(bridge) == ["reference: look.png (uploaded)"]
    assert np.array_equal(bridge.references[-1], image) and controls.state.reference is None
    ok, jpeg = cv2.imencode(".jpg", np.zeros((5000, 16, 3), np.uint8))  # too tall: its header says so, not decoded
    import base64

    big = "A" * ((page_controls.MAX_UPLOAD_BYTES + 2) // 3 * 4 + 4)
    png_head = base64.b64encode(b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR" + (9000).to_bytes(4, "big") * 2).decode()
    for fields, words in [({"data": base64.b64encode(b"GIF89a....").decode()}, "not a PNG or JPEG image"),
                          ({"data": "%%%"}, "not base64"),
                          ({}, "no image data"),
                          ({"data": big}, "over 8 MB"),
                          ({"data": base64.b64encode(jpeg.tobytes()).decode()}, "16x5000; expected 1 to 4096 px"),
                          ({"data": png_head}, "9000x9000"),
                          ({"data": _png(image)[:60]}, "damaged image")]:
        with pytest.raises(ControlError) as refused:
            page_controls.command_for({"control": "reference", "name": "x.png", **fields})
        assert words in str(refused.value) and str(refused.value).count("\n") == 0
    plain = Controls(ControlState(prompts=["ink"]))  # a model without VACE: refused when applied, counted
    plain.put(command)
    assert "no VACE control blocks" in plain.apply_pending(bridge)[-1] and plain.state.refused == 1


def test_a_reference_file_too_large_is_refused_from_its_header_without_decoding_it(tmp_path, monkeypatch):
    """OSC's /loom/reference PATH and the r key read the file on the frame loop: a 12000x12000 PNG of 0.5 MB
    took 3.5-11.7 s to decode there (the show's frames waiting), then the bridge refused it for its size. Its
    header says its sides, as the page's upload is checked: refused at once, the reference in use stays."""
    calls = []
    decode = cv2.imdecode
    monkeypatch.setattr(cv2, "imdecode", lambda *a: calls.append(1) or decode(*a))
    monkeypatch.setattr(cv2, "imread", lambda *a: calls.append(1) or pytest.fail("the file is decoded whole"))
    huge = tmp_path / "huge.png"
    huge.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR" + (12000).to_bytes(4, "big") * 2 + b"\x08\x02\0\0\0")
    tall = tmp_path / "tall.jpg"
    _, jpeg = cv2.imencode(".jpg", np.zeros((5000, 16, 3), np.uint8))
    tall.write_bytes(jpeg.tobytes())
    good = tmp_path / "look.png"
    cv2.imwrite(str(good), np.full((6, 4, 3), 10, np.uint8))
    controls, bridge = vace_controls(), RecordingBridge()
    controls.put(command_for("/loom/reference", (str(good),)))
    controls.apply_pending(bridge)
    calls.clear()
    for path, words in [(huge, "12000x12000; expected 1 to 4096 px a side"), (tall, "16x5000"),
                        (tmp_path, "cannot be read as an image"), (tmp_path / "gone.png", "gone.png: no such file")]:
        controls.put(command_for("/loom/reference", (str(path),)))
        line = controls.apply_pending(bridge)[-1]
        assert words in line and "the reference stays" in line and "\n" not in line
    assert calls == [] and len(bridge.references) == 1 and controls.state.refused == 4
    assert controls.state.reference == str(good)  # what r reads again


def test_r_reads_again_the_reference_a_config_names(tmp_path, monkeypatch):
    """A reference set in the config (or --set control.reference) is the one `r` reads again, as --reference's
    is: the player knew only --reference's, so after a clear the config's own could not be brought back."""
    import cv2

    import loom_live.plugin.player as player
    from loom_live.plugin.cli.main import main

    ref = tmp_path / "look.png"
    cv2.imwrite(str(ref), np.full((32, 32, 3), 200, np.uint8))
    seen = []
    monkeypatch.setattr(player, "run_player", lambda options: seen.append(options) or 0)
    assert main(["play", "-c", "tiny-vace", "--set", f"control.reference={ref}", "-o", str(tmp_path / "o.mp4")]) == 0
    assert seen[0].reference == str(ref)
