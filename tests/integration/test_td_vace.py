"""The TouchDesigner operator's VACE parts against the TD stand-ins and a real (pass-through) engine process:
the Script TOP's second input goes to the engine as control frames beside the input, the Control page's
scale and source reach it as live parameters, and the Reference TOP's picture as the reference image."""

from __future__ import annotations

import numpy as np

from loom_live.host_bridge.wire.pixels import from_touchdesigner
from loom_live.plugin.touchdesigner import osc_in_callbacks
from tests.fakes.touchdesigner import (
    COOK_BUDGET_S,
    InputTOP,
    StandInDeviceBuffer,
    configure,
    cook_until,
    make_component,
    start_device_bridge,
    td_texture,
)


def session(ext) -> dict:
    return ext.bridge.stats()["engine"].get("session") or {}


def test_the_second_input_the_control_page_and_the_reference_top_reach_the_engine():
    source, control = InputTOP(td_texture(12, 16, seed=1)), InputTOP(td_texture(12, 16, seed=2))
    comp, script, ext = make_component(source)
    script.inputs.append(control)  # what build_loom wires: in2 -> the Script TOP's second input
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Controlscale = 0.4
    comp.par.Controlsource = "video"
    comp.parexec_enabled = True
    comp.par.Active = True
    try:
        per_frame = int(from_touchdesigner(control.numpyArray()).astype(np.int64).sum())
        durations = cook_until(script, lambda: session(ext).get("control", {}).get("frames", 0) >= 3,
                               "control frames at the engine", 60)
        assert max(durations) < COOK_BUDGET_S, "a cook waited on the engine"
        report = session(ext)["control"]
        assert report["sum"] == per_frame * report["frames"]  # the control TOP's picture, in the engine's layout
        assert ext.vace and session(ext)["params"]["context_scale"] == 0.4
        assert session(ext)["params"]["control_source"] == "video"
        osc_in_callbacks.onReceiveOSC(_Dat(comp), 0, "", b"", 0.0, "/loom/control/scale", [1.5], None)
        reference = InputTOP(td_texture(6, 10, np.float32, seed=3))
        comp.par.Referencetop = reference
        want_sum = int(from_touchdesigner(reference.numpyArray()).astype(np.int64).sum())
        cook_until(script, lambda: session(ext)["control"]["reference"] == [6, 10, 3]
                   and session(ext)["params"]["context_scale"] == 1.5, "the reference and the new scale", 30)
        assert session(ext)["control"]["reference_sum"] == want_sum
        comp.par.Referencetop = ""  # emptied: streams without one
        cook_until(script, lambda: session(ext)["control"]["reference"] is None, "the reference cleared", 30)
        assert comp.par.State.eval() == "running" and "refused" not in comp.par.Message.eval()
    finally:
        comp.par.Active = False
        ext.WaitClosed()


def test_on_cuda_ipc_the_control_input_goes_device_to_device_beside_the_input():
    """The GPU path: the control TOP's cudaMemory is handed over with the input's, on the component's stream."""
    source, control = InputTOP(td_texture(12, 16, seed=1)), InputTOP(td_texture(12, 16, seed=2))
    comp, script, ext = make_component(source)
    script.inputs.append(control)
    start_device_bridge(comp, ext)
    try:
        per_frame = int(from_touchdesigner(control.texture).astype(np.int64).sum())
        cook_until(script, lambda: session(ext).get("control", {}).get("frames", 0) >= 3, "control frames", 60)
        report = session(ext)["control"]
        assert report["sum"] == per_frame * report["frames"] and report["missing"] == 0
        assert ext.numpy_submits == 0 and ext.input_note == ""
        assert ("submit_cuda control", StandInDeviceBuffer.STREAM) in ext.bridge.streams
        assert control.cuda_streams[-1] == StandInDeviceBuffer.STREAM
    finally:
        ext.Stop()


class _Dat:
    def __init__(self, comp) -> None:
        self._comp = comp

    def parent(self):
        return self._comp
