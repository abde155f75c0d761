"""A host script's mistakes with the Bridge API are refused at once, saying what to do (no engine is started)."""

from __future__ import annotations

import numpy as np
import pytest

from loom_live.host_bridge import Bridge, BridgeConfig, EngineState
from loom_live.host_bridge.wire.params import check_prompt_request
from loom_live.host_bridge.wire.typed_config import ConfigError


def test_an_empty_engine_config_is_refused_at_construction():
    with pytest.raises(ConfigError, match=r"engine_config: '' is not allowed; expected a string of at least 1"):
        BridgeConfig(engine_config="")


def test_a_config_field_set_after_construction_is_checked_when_the_bridge_takes_it():
    config = BridgeConfig(passthrough=True)
    config.ring_slots = 100  # past the rings' limit: before, the engine took no frame and nothing said why
    with pytest.raises(ConfigError, match=r"ring_slots: 100 is not allowed"):
        Bridge(config)


def test_start_after_close_is_refused_instead_of_starting_for_ever():
    bridge = Bridge(BridgeConfig(passthrough=True))
    bridge.close()
    with pytest.raises(RuntimeError, match="closed; make a new Bridge"):
        bridge.start()
    assert bridge.status().state == EngineState.STOPPED


def test_calls_that_need_an_engine_before_start_say_to_start_the_bridge():
    bridge = Bridge(BridgeConfig(passthrough=True))
    try:
        for call in (lambda: bridge.wait_running(0.1), lambda: bridge.set_prompt("ink", wait=True),
                     lambda: bridge.reset(wait=True), lambda: bridge.process([np.zeros((8, 8, 3), np.uint8)], 0.1)):
            with pytest.raises(RuntimeError, match=r"not started; call start\(\) first"):
                call()
    finally:
        bridge.close()


@pytest.mark.parametrize("text", [5, b"ink", ["ink"]])
def test_a_prompt_that_is_not_a_string_is_named_as_such(text):
    with pytest.raises(ValueError, match="expected a string"):
        check_prompt_request(text)
