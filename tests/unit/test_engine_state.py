"""Engine states are an enum in the bridge and plain text wherever a host shows or compares them."""

from __future__ import annotations

import json

from loom_live.host_bridge import BridgeStatus, EngineState


def test_states_read_as_their_status_text():
    assert f"{EngineState.RUNNING}" == str(EngineState.RUNNING) == "running"
    assert EngineState.DEAD == "dead" and "dead" in {EngineState.DEAD}
    assert EngineState("restarting") is EngineState.RESTARTING
    assert json.dumps({"state": EngineState.STOPPED}) == '{"state": "stopped"}'
    assert BridgeStatus().state is EngineState.STOPPED


def test_only_dead_and_stopped_have_ended():
    assert {s for s in EngineState if s.ended} == {EngineState.DEAD, EngineState.STOPPED}
