"""The live-parameter schema: one set of facts that the config, the wire, the engines and the hosts agree on."""

from __future__ import annotations

import pytest

from loom_live.engine.config import PromptConfig, load_config
from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.host_bridge.wanted import PromptWish, Wanted
from loom_live.host_bridge.wire.params import (
    LIVE,
    PROMPT,
    STEP_LISTS,
    LiveParam,
    ParamSchema,
    check_prompt_request,
    steps_for,
    whole_chunks,
)
from loom_live.host_bridge.wire.protocol import ProtocolError, make
from loom_live.plugin.comfyui.nodes import LoomPrompt
from loom_live.plugin.touchdesigner.parameters import PAR_BY_NAME


def test_config_defaults_are_the_schema_defaults():
    cfg = load_config("default")
    for p in LIVE:
        if p.kind == "scales":  # LoRA scales: the config's lora list, by name
            assert {e.key: e.scale for e in cfg.lora} == p.check(p.default)
            continue
        assert getattr(getattr(cfg, p.section), p.name) == p.check(p.default), p.name
    assert PromptConfig().text == PROMPT.default  # a preset may name its own prompt (the default: a style)


@pytest.mark.parametrize("params, word", [
    ({"steps": [500, 700]}, "descending"), ({"steps": [700] * 5}, "1 to 4"), ({"steps": [1000]}, "999"),
    ({"noise_scale": 1.5}, "[0.1, 1]"), ({"noise_scale": float("nan")}, "noise_scale"),
    ({"motion_aware": 1}, "true or false"), ({"mode": "fast"}, "'auto', 'batch', 'sequential'"),
    ({"transition_chunks": -1}, "[0, 1000]"), ({"bogus": 1}, "unknown parameter; settable: steps"),
])
def test_every_reader_refuses_the_same_bad_value_with_the_same_words(params, word):
    with pytest.raises(ValueError, match=f"{list(params)[0]}.*") as refused:
        LIVE.check(params)
    assert word in str(refused.value)
    with pytest.raises(ProtocolError, match="params.params"):
        make("params", params=params)
    with pytest.raises(ValueError) as engine_refused:
        PassthroughSession().set_params(**params)
    assert word in str(engine_refused.value)


def test_good_values_pass_every_reader_as_the_engine_takes_them():
    params = {"steps": (700, 500), "noise_scale": 1, "motion_aware": False, "transition_chunks": 0}
    assert LIVE.check(params) == {"steps": [700, 500], "noise_scale": 1.0, "motion_aware": False,
                                  "transition_chunks": 0}
    make("params", params=LIVE.check(params))
    make("prompt", text="ink", transition_chunks=1000)
    with pytest.raises(ProtocolError, match="prompt.transition_chunks"):
        make("prompt", text="ink", transition_chunks=1001)


def test_step_lists_and_chunk_arithmetic():
    assert all(LIVE["steps"].problem(list(v)) is None and len(v) == n for n, v in STEP_LISTS.items())
    assert steps_for(3) == [700, 500, 400]
    with pytest.raises(ValueError, match="expected 1, 2, 3 or 4"):
        steps_for(7)
    assert [whole_chunks(n) for n in (1, 2, 5)] == [5, 9, 21]


def test_prompt_limits():
    assert check_prompt_request("  ink wash ", 3) == ("ink wash", 3)
    for text, why in (("  ", "prompt is empty"), ("x" * 5000, "at most 4096"), (None, "prompt is empty")):
        with pytest.raises(ValueError, match=why):
            check_prompt_request(text)
    with pytest.raises(ValueError, match="empty; give a few words describing the style"):
        check_prompt_request(" ")
    with pytest.raises(ValueError, match="empty; give an instruction, such as 'make it a watercolor painting'"):
        check_prompt_request(" ", family="edit")  # the edit family's prompt is an instruction, not a style
    with pytest.raises(ValueError) as unknown:  # a host before its engine said its family: what each one takes
        check_prompt_request(" ", family=None)
    assert str(unknown.value) == ("the prompt is empty; give a few words describing the style (the wan family) or "
                                  "an instruction, such as 'make it a watercolor painting' (the edit family)")


def test_hosts_offer_the_schema_ranges():
    noise, chunks = LoomPrompt.INPUT_TYPES()["required"]["noise_scale"], PAR_BY_NAME["Transition"]
    assert noise == ("FLOAT", {"default": 0.8, "min": 0.1, "max": 1.0, "step": 0.05, "tooltip": noise[1]["tooltip"]})
    assert (chunks.default, chunks.min, chunks.max) == (4, 0, LIVE["transition_chunks"].ui_max)
    assert (PAR_BY_NAME["Steps"].min, PAR_BY_NAME["Steps"].max) == (1, 4)


def test_a_family_adds_its_own_parameters_without_touching_the_shared_ones():
    guidance = LiveParam("edit_strength", "float", 1.0, "example", "how far the edit departs from the source",
                         min=0.0, max=2.0)
    family = LIVE.extended(guidance)
    assert family.check({"edit_strength": 0.5, "steps": [700]}) == {"edit_strength": 0.5, "steps": [700]}
    assert "edit_strength" not in LIVE and family.section("example") == ("edit_strength",)
    with pytest.raises(ValueError, match="already registered"):
        ParamSchema(guidance, guidance)
    with pytest.raises(ValueError, match="default"):
        LiveParam("bad", "int", 9, "x", min=0, max=4)


def test_wanted_tells_a_fresh_engine_everything_once_and_undoes_a_refusal():
    wanted = Wanted()
    assert wanted.for_fresh_engine() == []
    wanted.want_prompt(PromptWish("ink", 4))
    undo = wanted.want_prompt(PromptWish("oil", 2))
    wanted.want_params({"steps": [700]})
    wanted.want_params({"noise_scale": 0.5})
    assert wanted.for_fresh_engine() == [("prompt", {"text": "oil", "transition_chunks": 0}, []),
                                         ("params", {"params": {"steps": [700], "noise_scale": 0.5}}, [])]
    undo()
    assert wanted.snapshot().prompt == PromptWish("ink", 4)


def test_lora_scales_are_a_mapping_of_names_to_bounded_numbers():
    assert LIVE.check({"lora_scales": {"ink": 1, "film": -0.5}}) == {"lora_scales": {"ink": 1.0, "film": -0.5}}
    for bad in ({"ink": 9.0}, {"": 1.0}, {"ink": float("nan")}, ["ink", 1.0], {f"l{i}": 1.0 for i in range(9)}):
        assert "lora_scales" in LIVE.problem({"lora_scales": bad})


def test_wanted_lora_scales_add_up_by_name():
    wanted = Wanted()
    wanted.want_params({"lora_scales": {"ink": 0.5}})
    undo = wanted.want_params({"lora_scales": {"film": 0.2}})
    assert wanted.params["lora_scales"] == {"ink": 0.5, "film": 0.2}
    undo()
    assert wanted.params["lora_scales"] == {"ink": 0.5}


def test_a_loras_default_scale_and_name_are_one_fact_for_the_engine_and_the_hosts(tmp_path):
    from loom_live.engine.config import LoraEntry
    from loom_live.host_bridge.loras import lora_choice
    from loom_live.host_bridge.wire.params import LORA_DEFAULT_SCALE, lora_name

    (tmp_path / "ink.v2.safetensors").write_bytes(b"")
    entry = load_config("default", [f"lora=[{{path: {tmp_path / 'ink.v2.safetensors'}}}]"]).lora[0]
    assert entry.scale == LORA_DEFAULT_SCALE == PAR_BY_NAME["Lora1scale"].default
    assert entry.key == lora_name(entry.path) == lora_choice(entry.path, entry.scale).name == "ink.v2"
    assert LoraEntry(path="a/ink.safetensors", name="film").key == "film"  # a config may name it itself
