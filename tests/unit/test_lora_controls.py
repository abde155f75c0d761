"""LoRA scales from the player's keys and OSC reach the bridge as one lora_scales update per frame."""

from __future__ import annotations

import pytest

from loom_live.plugin.player.controls import (
    Command,
    ControlError,
    Controls,
    ControlState,
    KeyboardInput,
    lora_scale_command,
)
from loom_live.plugin.player.osc import command_for, refusal


class RecordingBridge:
    def __init__(self) -> None:
        self.params: list[dict] = []

    def set_params(self, **params) -> None:
        self.params.append(params)

    def set_prompt(self, text, transition_chunks=None) -> None:
        pass


def _controls(**scales: float) -> Controls:
    return Controls(ControlState(prompts=["ink"], lora_scales=dict(scales)))


def test_keys_select_a_lora_and_step_its_scale():
    controls, bridge = _controls(ink=1.0, film=0.5), RecordingBridge()
    keys = KeyboardInput(controls)
    for key in ".l,,":
        keys.press(ord(key))
    controls.apply_pending(bridge)
    assert bridge.params == [{"lora_scales": {"ink": 1.05, "film": 0.4}}]
    assert controls.state.message == "LoRA film: scale 0.40"


def test_osc_sets_a_named_lora_and_refuses_what_is_not_allowed():
    controls, bridge = _controls(ink=1.0), RecordingBridge()
    controls.put(command_for("/loom/lora/scale", ("ink", 0.25)))
    controls.apply_pending(bridge)
    assert bridge.params == [{"lora_scales": {"ink": 0.25}}]
    with pytest.raises(ControlError, match=r"lora scale: 'ink' 9 is not allowed; expected the name of a loaded LoRA "
                                           r"and a number in \[-4, 4\]$"):
        lora_scale_command("ink", 9)
    with pytest.raises(ControlError, match="wrong arguments"):
        command_for("/loom/lora/scale", (0.5,))
    controls.put(Command("lora_scale", ("nope", 1.0)))
    controls.apply_pending(bridge)
    assert controls.state.message == "no LoRA named 'nope'; loaded: ink" and len(bridge.params) == 1
    assert controls.state.refused == 1  # counted with the other refusals (the status line shows the count)


@pytest.mark.parametrize("args, said", [(("ink", 5), "'ink' 5 is not allowed"),
                                        (("ink", "loud"), "'loud' is not a number")])
def test_an_osc_scale_is_refused_in_the_words_of_what_the_address_takes(args, said):
    """`/loom/lora/scale ink 5` was refused with the wire's "a mapping of at most 8 names ... to numbers in [-4, 4]";
    the sender typed a name and a number (`name f`), and the page's slider sends the same (its tooltip too)."""
    from loom_live.plugin.web.page_controls import schema

    with pytest.raises(ControlError) as refused:
        command_for("/loom/lora/scale", args)
    assert refusal("/loom/lora/scale", str(refused.value)) == (
        f"OSC refused /loom/lora/scale: {said}; expected the name of a loaded LoRA and a number in [-4, 4]")
    assert schema()["lora_scale"]["allowed"] == "a number in [-4, 4]"


def test_without_loras_the_keys_say_how_to_load_one():
    controls, bridge = _controls(), RecordingBridge()
    KeyboardInput(controls).press(ord("."))
    controls.apply_pending(bridge)
    assert bridge.params == [] and "--lora" in controls.state.message


def test_a_hosts_lora_arguments_are_what_the_engine_reads_and_its_refusal_names_the_file():
    import json

    from loom_live.engine.host_overrides import lora_override
    from loom_live.host_bridge.loras import LoraChoice, engine_args, refused_lora

    choices = [LoraChoice(r"C:\loras\ink.safetensors", 0.1 + 0.2), LoraChoice("/loras/ink.safetensors.bak", 1.0)]
    args = engine_args(choices)
    assert args[0::2] == ["--lora", "--lora"]
    (override,) = lora_override(args[1::2])
    assert json.loads(override.removeprefix("lora=")) == [{"path": c.path, "scale": c.scale} for c in choices]
    failure = ("session could not be built: LoraError: /loras/ink.safetensors.bak: shapes that do not fit this "
               "model (a LoRA for another model size?): blocks.0.self_attn.q\nTraceback ...")
    choice, words = refused_lora(failure, [LoraChoice("/loras/ink.safetensors", 1.0), choices[1]])
    assert choice == choices[1] and words.startswith("/loras/ink.safetensors.bak: shapes") and "Traceback" not in words
    assert refused_lora("engine exited with code 3", choices) is None


def test_a_lora_scale_that_is_not_a_number_is_named_as_the_scale_not_the_file(tmp_path):
    """`--lora ink.safetensors:O.8` (a letter O) was read as the file 'ink.safetensors:O.8' and refused as
    "no such file or directory", of a file that is there. A colon of the path itself still reads as the path."""
    import json
    import re

    from loom_live.engine.host_overrides import lora_override
    from loom_live.host_bridge.wire.typed_config import ConfigError

    lora = tmp_path / "ink.safetensors"
    lora.write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(f"--lora {lora}:O.8: the scale 'O.8' is not a number; expected "
                                                    f"PATH[:SCALE], e.g. {lora}:0.8")):
        lora_override([f"{lora}:O.8"])
    (override,) = lora_override([f"{tmp_path}/no:such.safetensors"])
    assert json.loads(override.removeprefix("lora=")) == [{"path": f"{tmp_path}/no:such.safetensors", "scale": 1.0}]


def test_a_served_engine_s_loras_are_the_ones_the_keys_step():
    """`--lora` loads none into an engine served with its own config: the controls hold the engine's LoRAs, a scale
    given for one it has is sent (and held), one it lacks is not sent."""
    controls, bridge = _controls(ink=0.5, mine=0.5), RecordingBridge()
    start = {"prompt": "oil", "params": {"lora_scales": {"ink": 1.0, "film": 0.8}}}
    controls.follow_engine(start)
    taken, unsent = controls.take_start(start, bridge, prompt_given=True,
                                        given={"lora_scales": {"ink": 0.5, "mine": 0.5}})
    assert taken == {"lora_scales": {"ink": 0.5, "film": 0.8}} and controls.state.lora_scales == taken["lora_scales"]
    assert bridge.params == [{"lora_scales": {"ink": 0.5}}] and unsent == ["lora_scales 'mine' (no such LoRA there)"]
    assert controls.state.prompts == ["ink"]  # -p given: kept
