"""The player's and OSC's control of the edit family's temporal adapter strength (`adapter_strength`): its range and
key step are the live-parameter schema's, a bad value is refused in words, an engine that does not take it (a Wan
one) is never sent it, and the overlay shows it only where the engine takes it (the page: test_web_parts.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loom_live.host_bridge.wire.params import ADAPTER_STRENGTH, EDIT_FAMILY_PARAMS, WAN_PARAMS
from loom_live.plugin.player.controls import (
    Command,
    ControlError,
    Controls,
    ControlState,
    KeyboardInput,
    adapter_strength_command,
)
from loom_live.plugin.player.osc import OSC_ADDRESSES, command_for
from tests.fakes.bridges import RecordingBridge

EDIT_TAKES = frozenset(p.name for p in EDIT_FAMILY_PARAMS)
WAN_TAKES = frozenset(p.name for p in WAN_PARAMS)


def _controls(family: str = "edit", takes: frozenset[str] | None = EDIT_TAKES) -> Controls:
    return Controls(ControlState(prompts=["make it ink"], family=family, takes=takes))


def _press(controls: Controls, keys: str) -> RecordingBridge:
    bridge, keyboard = RecordingBridge(), KeyboardInput(controls)
    for key in keys:
        keyboard.press(ord(key))
    controls.apply_pending(bridge)
    return bridge


def test_keys_step_the_adapter_strength_by_the_schema_s_step_and_stop_at_its_range():
    controls = _controls()
    assert _press(controls, "'';").params == [{"adapter_strength": 1.05}]  # one update per frame
    assert controls.state.message == "adapter strength: 1.05"
    assert _press(controls, "'" * 30).params == [{"adapter_strength": ADAPTER_STRENGTH.max}]
    assert _press(controls, ";" * 50).params == [{"adapter_strength": ADAPTER_STRENGTH.min}]
    assert _press(controls, "'").params == [{"adapter_strength": ADAPTER_STRENGTH.ui_step}]


def test_osc_sets_the_adapter_strength_and_bad_values_are_refused_in_words():
    assert command_for("/loom/adapter_strength", (0.25,)) == Command("adapter_strength", (0.25,))
    assert command_for("/loom/adapter_strength", (2,)) == Command("adapter_strength", (2.0,))  # an OSC int
    allowed = r"expected a number in \[0, 2\]"
    for args, why in [((2.5,), rf"adapter_strength: '2.5' is not allowed; {allowed}"),
                      ((-0.05,), rf"adapter_strength: '-0.05' is not allowed; {allowed}"),
                      ((float("nan"),), rf"adapter_strength: 'nan' is not allowed; {allowed}"),
                      (("lots",), rf"adapter_strength: 'lots' is not a number; {allowed}"),
                      ((10 ** 400,), rf"is not a number; {allowed}"),
                      ((), r"/loom/adapter_strength: wrong arguments \[\]; expected f"),
                      ((0.5, 1), r"wrong arguments \[0.5, 1\]; expected f")]:
        with pytest.raises(ControlError, match=why):
            command_for("/loom/adapter_strength", args)
    assert OSC_ADDRESSES["/loom/adapter_strength"] == ("f", "edit presets: temporal adapter strength, 0..2 "
                                                             "(0: no temporal adapter)")
    controls, bridge = _controls(), RecordingBridge()
    controls.put(command_for("/loom/adapter_strength", (0.3,)))
    controls.apply_pending(bridge)
    assert bridge.params == [{"adapter_strength": 0.3}] and controls.state.adapter_strength == 0.3


def test_an_engine_that_does_not_take_it_is_not_sent_it_and_is_said_to_take_what_it_takes():
    controls = _controls("wan", WAN_TAKES)
    controls.put(adapter_strength_command(0.5))
    assert _press(controls, "'").params == []
    s = controls.state
    assert s.message == ("adapter_strength: the engine's model (wan family) does not take it; it takes "
                         f"{', '.join(sorted(WAN_TAKES))}")
    assert s.refused == 2 and s.adapter_strength == ADAPTER_STRENGTH.default


def test_the_overlay_shows_the_adapter_strength_only_where_the_engine_takes_it():
    """As the engine said (`takes`), or before it says, as the run's model family takes it."""
    edit, wan = "adapter 1.00", "steps 2  noise 0.80  motion on"
    assert _controls().state.settings_line() == edit
    assert _controls("wan", WAN_TAKES).state.settings_line() == wan
    assert _controls("edit", None).state.settings_line() == edit
    assert _controls("wan", None).state.settings_line() == wan
    assert _controls("edit", frozenset()).state.settings_line() == ""  # a served engine that has not said yet


def test_a_served_edit_engine_s_own_strength_is_taken_and_one_the_command_line_gave_is_sent_once():
    """Given on the command line, the strength is sent and held, whatever -c's model (a Wan one holds the default:
    `loom play -c default --set edit.adapter_strength=0.4 --endpoint`): the keys step from it."""
    start = {"prompt": "make it ink", "params": {"adapter_strength": 0.7, "cond_refresh_every": 8}, "family": "edit"}
    controls, bridge = _controls(None, frozenset()), RecordingBridge()
    controls.follow_engine(start)
    assert controls.take_start(start, bridge, prompt_given=True, given={}) == ({"adapter_strength": 0.7}, [])
    assert bridge.params == [] and controls.state.settings_line() == "adapter 0.70"
    assert _press(controls, "'").params == [{"adapter_strength": 0.75}]  # from the engine's, not the default
    given = Controls(ControlState(prompts=["make it ink"], family=None, takes=frozenset()))
    given.follow_engine(start)
    assert given.take_start(start, bridge, prompt_given=True, given={"adapter_strength": 0.4}) == ({}, [])
    assert bridge.params == [{"adapter_strength": 0.4}] and given.state.settings_line() == "adapter 0.40"
    assert _press(given, ";").params == [{"adapter_strength": 0.35}]


def test_a_launched_run_takes_what_its_config_takes_before_its_engine_says(monkeypatch):
    """Before a launched engine is ready (a GPU model warms up for most of a minute) the player knows what -c's config
    takes: a Wan key on an edit run is refused in the player from the start, not sent and refused by the engine, and
    the page's state names the parameters so that it never offers the others; --endpoint still knows nothing yet."""
    from loom_live.plugin import player
    from loom_live.plugin.cli.main import main
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.web.page_controls import control_state

    seen = []
    monkeypatch.setattr(player, "run_player", lambda options: seen.append(options) or 0)
    assert main(["play", "-c", "edit-tiny", "--passthrough", "-n", "5"]) == 0
    controls = Player(seen[0]).controls
    assert control_state(controls.state)["takes"] == sorted(EDIT_TAKES)
    assert _press(controls, "]").params == []  # noise scale up: a Wan parameter
    assert controls.state.message.startswith("noise_scale: the engine's model")
    assert "adapter_strength" in controls.state.message
    served = replace(seen[0], endpoint="tcp://127.0.0.1:9", passthrough=False)  # it runs its own config, not -c's
    assert control_state(Player(served).controls.state)["takes"] == []
