"""The run configuration: presets load, overrides apply, and every bad input names its key."""

from __future__ import annotations

import contextlib
import re

import pytest

from loom_live.engine.config import ConfigError, LoomConfig, list_presets, load_config, model_family
from loom_live.engine.host_overrides import ServedKeyError, check_overrides, served_overrides


def test_every_shipped_preset_loads():
    assert {"default", "wan2.1-1.3b", "wan2.1-14b"} <= set(list_presets())
    for name in list_presets():
        assert isinstance(load_config(name), LoomConfig)


def test_default_is_the_trained_embedded_model():
    cfg = load_config()
    assert cfg.model.preset == "embedded" and cfg.model.checkpoint is None and cfg.prompt.encoder == "style"
    assert cfg.resolution.width >= 192 and cfg.resolution.height >= 192
    assert cfg.stream.num_kv_cache == 6 and cfg.stream.sink == 3
    tiny = load_config("tiny-random")  # the seeded random-weight model the tests use
    assert tiny.model.preset == "tiny" and tiny.prompt.encoder == "hash"


def test_overrides_parse_yaml_values():
    cfg = load_config("wan2.1-1.3b", ["stream.steps=[700, 500, 400]", "noise.noise_scale=0.6",
                                      "model.checkpoint=/w/model.pt", "vae.decoder=taehv"])
    assert cfg.stream.steps == [700, 500, 400]
    assert cfg.noise.noise_scale == 0.6
    assert cfg.model.checkpoint == "/w/model.pt"
    assert cfg.vae.decoder == "taehv"
    assert (cfg.resolution.width, cfg.resolution.height) == (832, 480)


def test_yaml_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model: {preset: wan2.1-1.3b}\nresolution: {width: 512, height: 512}\n")
    cfg = load_config(f)
    assert cfg.model.preset == "wan2.1-1.3b" and cfg.resolution.width == 512


def _error(tmp_path, text: str | None = None, overrides=(), name=None) -> str:
    target = name
    if text is not None:
        target = tmp_path / "bad.yaml"
        target.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(target, list(overrides))
    return str(info.value)


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("", ["bad.yaml", "empty"]),
        ("- a\n- b\n", ["bad.yaml", "mapping"]),
        ("model: {presett: tiny}\n", ["bad.yaml", "model.presett", "unknown key", "preset"]),
        ("resolution: {width: -64}\n", ["resolution.width", "-64", "[16, 4096]"]),
        ("resolution: {height: 250}\n", ["resolution.height", "250", "multiple of 16"]),
        ("stream: {steps: [500, 700]}\n", ["stream.steps", "descending"]),
        ("stream: {steps: [900, 700, 500, 300, 100]}\n", ["stream.steps", "1 to 4 items"]),
        ("stream: {steps: [1700]}\n", ["stream.steps[0]", "1700"]),
        ("stream: {num_kv_cache: 3, sink: 3}\n", ["stream.sink", "smaller than num_kv_cache"]),
        ("stream: {rope_refresh_at: 4}\n", ["stream.rope_refresh_at", "larger than num_kv_cache"]),
        ("noise: {motion_aware: yes please}\n", ["noise.motion_aware", "true or false"]),
        ("model: {preset: wan3}\n", ["model.preset", "'wan3'", "wan2.1-1.3b"]),
        ("model: {device: gpu0}\n", ["model.device", "cuda:N"]),
        ("prompt: {text: '  '}\n", ["prompt.text: the prompt is empty; give a few words describing the style"]),
        ("model: {family: edit}\nprompt: {text: ''}\n",
         ["bad.yaml: prompt.text: the prompt is empty; give an instruction, such as 'make it a watercolor painting'"]),
        ("prompt: {text: null}\n", ["prompt.text: the prompt is empty"]),
        ("model: [1, 2]\n", ["model", "expected a mapping"]),
        ("model: {preset: tiny\n", ["bad.yaml", "not valid YAML"]),
        ("noise: {noise_scale: .nan}\n", ["noise.noise_scale", "nan", "a finite number in [0.1, 1.0]"]),
        ("stream: {timestep_shift: .inf}\n", ["stream.timestep_shift", "a finite number"]),
        ("stream: {seed: 99999999999999999999999}\n", ["stream.seed", "an integer of at most 64 bits"]),
    ],
)
def test_bad_files_name_file_key_value_and_what_is_allowed(tmp_path, text, fragments):
    message = _error(tmp_path, text)
    for frag in fragments:
        assert frag in message, message


def test_unknown_preset_lists_the_available_ones(tmp_path):
    message = _error(tmp_path, name="wan9")
    assert "unknown preset 'wan9'" in message and "default" in message


def test_missing_file(tmp_path):
    assert "not found" in _error(tmp_path, name=tmp_path / "nope.yaml")
    assert "not found" in _error(tmp_path, name=str(tmp_path / "Nope.YAML"))  # a file by its suffix, any case
    assert "is a folder" in _error(tmp_path, name=str(tmp_path))
    assert "did you mean" not in _error(tmp_path, name=tmp_path / "nope.yaml")


def test_a_missing_file_named_like_a_preset_names_the_preset(tmp_path):
    """`-c default.yaml` where no such file is said only "config file not found"; the preset is named."""
    message = _error(tmp_path, name=tmp_path / "edit-tiny.yaml")
    assert message.endswith("config file not found; did you mean the preset 'edit-tiny' (-c edit-tiny)?"), message


def test_the_model_family_is_read_before_the_config_is_built():
    """`loom bench` refuses a Wan-only option on the edit family by the option's name, so it reads the family
    (with the overrides) before building the config."""
    assert model_family("edit-tiny") == "edit" and model_family("tiny-random") == "wan"
    assert model_family("tiny-random", ["model.family=edit"]) == "edit"
    assert model_family(None, ["model=[1]"]) == "wan"  # not a section: the build says so


def test_a_preset_name_is_the_preset_whatever_the_working_folder_holds(tmp_path, monkeypatch):
    """A folder or file called `default` where the user runs must not replace (or break) the default."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    (tmp_path / "tiny-random").write_text("model: {preset: tiny}\nprompt: {encoder: style}\n")
    assert load_config().model.preset == "embedded" and load_config("default").model.preset == "embedded"
    assert load_config("tiny-random").prompt.encoder == "hash"  # the preset, not the file
    assert load_config("./tiny-random").prompt.encoder == "style"  # the file, named as a path


def test_bad_override():
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["noequals"])
    with pytest.raises(ConfigError, match="stream.num_kv_cache.*integer"):
        load_config(None, ["stream.num_kv_cache=six"])
    with pytest.raises(ConfigError, match=r"--set model=: model is a section; set one of its keys \(model.KEY"):
        load_config("tiny-random", ["model="])  # not a silent reset of the preset's model to the defaults


@pytest.mark.parametrize("key", ["noise.noise_scale", "stream.timestep_shift", "slo.target_fps"])
def test_a_whole_number_past_the_float_range_is_refused_by_name(key):
    """A float key given a 400-digit whole number: a ConfigError naming it, not an OverflowError traceback
    out of the finiteness check (from `loom serve --set`, or a live `set_params`)."""
    with pytest.raises(ConfigError, match=rf"{key}: 9+\.\.\.9+ is not allowed; expected a finite number"):
        load_config("default", [f"{key}={'9' * 400}"])


def test_a_kv_window_smaller_than_the_first_chunk_is_refused_at_load():
    """A stream's first chunk (5 frames) is 2 latent frames: a 1-frame window loaded, then failed every
    first chunk with 'does not fit a 1-frame KV window'."""
    with pytest.raises(ConfigError, match=r"stream.num_kv_cache: 1 is not allowed; expected a value in \[2, 64\]"):
        load_config("default", ["stream.num_kv_cache=1", "stream.sink=0"])
    assert load_config("default", ["stream.num_kv_cache=2", "stream.sink=0"]).stream.num_kv_cache == 2


def test_start_settings_are_the_config_s_prompt_and_live_parameters():
    """What the ready message says a session starts on: the prompt and each live parameter its family takes
    with the config's value (LoRA scales by name), JSON-able, and what `with_live` takes back unchanged. Another
    family's parameters are not listed: a host offering them back would be refused by name. The family is named:
    a host says an empty prompt in its words."""
    import json

    from loom_live.host_bridge.wire import params as live

    default = load_config().start_settings()
    assert default["prompt"] == "pencil sketch" and default["params"]["lora_scales"] == {}
    assert set(default["params"]) == {p.name for p in live.WAN_CONTROL_PARAMS}  # the embedded model reads edges
    assert default["params"]["steps"] == [700, 500] and default["params"]["noise_scale"] == 0.8
    assert default["params"]["control_source"] == "edges" and "adapter_strength" not in default["params"]
    plain = load_config("wan2.1-1.3b").start_settings()["params"]
    assert set(plain) == {p.name for p in live.WAN_PARAMS} and "context_scale" not in plain
    edit = load_config("dreamlite-edit")
    assert set(edit.start_settings()["params"]) == {"adapter_strength", "cond_refresh_every", "prompt_refresh_every",
                                                    "target_fps", "latency_budget_ms"}
    assert edit.with_live(edit.start_settings()["params"]) == edit
    assert (default["family"], edit.start_settings()["family"]) == ("wan", "edit")
    cfg = load_config("tiny-vace", ['lora=[{"path": "/w/ink_style.safetensors", "scale": 0.5}]', "noise.noise_scale=1",
                                    "stream.steps=[600]", "control.context_scale=0.7", "prompt.text=ink wash"])
    start = cfg.start_settings()
    assert start["prompt"] == "ink wash" and start["params"]["lora_scales"] == {"ink_style": 0.5}
    assert start["params"]["steps"] == [600] and start["params"]["context_scale"] == 0.7
    assert start["params"]["noise_scale"] == 1.0 and isinstance(start["params"]["noise_scale"], float)
    assert json.loads(json.dumps(start)) == start and live.LIVE.check(start["params"]) == start["params"]
    assert cfg.with_live(start["params"]) == cfg
    start["params"]["steps"].append(1)  # a copy: the config keeps its own
    assert cfg.stream.steps == [600]


def test_start_settings_say_the_structure_control_a_host_may_ask_for():
    """A host attached to a served engine (`loom play --endpoint`) checks --control and --reference against what the
    engine says it takes, not against its own -c config: the sources a session can make and whether it reads a
    reference image."""
    for name, sources, reference in (("default", ["edges"], False), ("tiny-vace", ["edges", "grey", "flow"], True),
                                     ("wan2.1-1.3b", [], False), ("edit-tiny", [], False)):
        start = load_config(name).start_settings()
        assert (start["control_sources"], start["takes_reference"]) == (sources, reference), name


def test_served_overrides_are_the_live_parameters_of_every_family_and_the_host_s_prompt():
    """What a host attached to an engine served with its own config (`--endpoint`) tells it: the live parameters a
    --set (or --lora) set, by their key or their section written whole, of any model family (-c's is not the served
    engine's), each checked as the config checks it; prompt.text is kept for the host's own config."""
    overrides = ["stream.steps=[600]", "prompt.text=ink wash", "noise={noise_scale: 0.5}", "edit.adapter_strength=0.6",
                 "control.context_scale=0.5", 'lora=[{"path": "/w/ink_style.safetensors", "scale": 0.5}]']
    assert served_overrides(overrides) == (['prompt.text="ink wash"'], {
        "steps": [600], "noise_scale": 0.5, "adapter_strength": 0.6, "context_scale": 0.5,
        "lora_scales": {"ink_style": 0.5}})
    assert served_overrides(["prompt={text: café 🎨, transition_chunks: 2}"]) == (
        ['prompt.text="café 🎨"'], {"transition_chunks": 2})
    assert load_config("default", ['prompt.text="café 🎨"']).prompt.text == "café 🎨"
    with pytest.raises(ConfigError, match=r"^--set: edit.adapter_strength: 5.0 is not allowed; expected a value in "
                                          r"\[0.0, 2.0\]$"):
        served_overrides(["edit.adapter_strength=5"])


@pytest.mark.parametrize(("overrides", "said"), [
    (["stream.steps=[700]", "noise={noise_scale: 9}"],
     "{}: noise.noise_scale: 9.0 is not allowed; expected a value in [0.1, 1.0]"),
    (["stream.steps=[700,"], "{}: not valid YAML at line 1, column 6: expected the node content, but found "
                             "'<stream end>'"),
    (["stream.steps=[9999]", "noise.noise_scale=0.5", "stream.steps=[9999, 500]"],
     "{}: stream.steps[0]: 9999 is not allowed; expected a value in [1, 999]"),
    (["lora=[{path: /w/a.safetensors}, {path: /w/a.safetensors}]"],
     "{}: lora: two LoRAs share a name (a, a); give each a distinct name"),
])
def test_served_overrides_name_a_value_not_allowed_by_its_source_or_the_command_line(overrides, said):
    """A live parameter's value not allowed, or no YAML, is named by the override that set it (the last one that
    set its key), in a host's own words where it gives them (ComfyUI's `overrides line N`: its user has no `--set`);
    `loom play --endpoint` says it as it always did."""
    last = f"line {len(overrides)}"
    with pytest.raises(ConfigError) as refused:
        served_overrides(overrides, [f"line {n}" for n in range(1, len(overrides) + 1)])
    assert str(refused.value) == said.format(last)
    cli = f"--set {overrides[-1]}" if "YAML" in said else "--set"
    with pytest.raises(ConfigError) as refused:
        served_overrides(overrides)
    assert str(refused.value) == said.format(cli)


def test_served_overrides_check_the_value_that_counts():
    """A key set twice keeps its last value, as a config's overrides do: an earlier one not allowed is not refused."""
    assert served_overrides(["stream.steps=[9999]", "stream.steps=[700]"], ["line 1", "line 2"]) == (
        [], {"steps": [700]})


@pytest.mark.parametrize("override", ["model.dtype=float16", "resolution.width=512", "noise.ema=0.5", "noise={}"])
def test_served_overrides_refuse_a_key_a_served_engine_never_reads(override):
    """A key that is no live parameter cannot reach an engine served with its own config: it is named, with what
    does reach it and where to set it, not dropped without a word."""
    key = override.partition("=")[0]
    with pytest.raises(ServedKeyError) as refused:  # its fields: a host's own words (the ComfyUI node's)
        served_overrides([override])
    assert (refused.value.override, refused.value.key) == (override, key)
    said = str(refused.value)
    assert said.startswith(f"--set {override}: a served engine (--endpoint) runs its own config, and only the live "
                           "parameters reach it (stream.steps, "), said
    assert "edit.adapter_strength" in said and "control.context_scale" in said and "and prompt.text" in said, said
    assert said.endswith(f"set {key} where it is served (loom serve --set {key}=...), or leave out --endpoint"), said


def test_numbers_in_exponent_form_are_numbers(tmp_path):
    """YAML 1.2 and JSON read 5e-1 and 1e3 as numbers; PyYAML's YAML 1.1 read them as strings, and a number
    key refused the number the user wrote: "noise.noise_scale: '5e-1' is not allowed; expected a finite number"."""
    f = tmp_path / "run.yaml"
    f.write_text("noise: {noise_scale: 5e-1}\nstream: {timestep_shift: 1.5E+1}\n")
    cfg = load_config(f, ["slo.latency_budget_ms=1e3", "slo.target_fps=.3e2"])
    assert (cfg.noise.noise_scale, cfg.stream.timestep_shift) == (0.5, 15.0)
    assert (cfg.slo.latency_budget_ms, cfg.slo.target_fps) == (1000.0, 30.0)
    with pytest.raises(ConfigError, match=r"stream.seed: 1000.0 is not allowed; expected an integer"):
        load_config(None, ["stream.seed=1e3"])  # a whole number is written as one, as for resolution.width
    assert load_config(None, ["prompt.text=e3 1e3x"]).prompt.text == "e3 1e3x"


@pytest.mark.parametrize("preset, override, key", [
    ("tiny-random", "edit.batch=4", "edit.batch"),
    ("wan2.1-1.3b", "edit.encoder=qwen3-vl", "edit.encoder"),
    ("edit-tiny", 'lora=[{"path": "ink.safetensors"}]', "lora"),
    ("edit-tiny", "stream.steps=[700]", "stream.steps"),
    ("edit-tiny", "noise.noise_scale=0.5", "noise.noise_scale"),
    ("edit-tiny", "model.checkpoint=/w/model.pt", "model.checkpoint"),
    ("edit-tiny", "vae.checkpoint=/w/vae.pth", "vae.checkpoint"),
    ("edit-tiny", "vae.dtype=float16", "vae.dtype"),
    ("dreamlite-edit", "prompt.encoder=umt5", "prompt.encoder"),
    ("dreamlite-edit", "memory.low_vram=true", "memory.low_vram"),
])
def test_a_key_the_model_family_does_not_read_is_refused(preset, override, key):
    """A LoRA given to an edit run (or `edit.batch` to a Wan run) was dropped without a word, exit 0."""
    family = load_config(preset).model.family
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: model.family={family} does not read it"):
        load_config(preset, [override])


def test_what_bench_and_prepare_set_for_every_family_still_loads_for_the_edit_family():
    cfg = load_config("edit-tiny", ["model.random_weights=true", "vae.random_weights=true", "prompt.encoder=hash",
                                    "model.saved_block_ops=build", "vae.saved_steps=build", "slo.target_fps=24"])
    assert cfg.model.family == "edit" and cfg.slo.target_fps == 24


def test_a_typo_names_the_key_or_preset_meant(tmp_path):
    assert "stream.num_kv_cahce: unknown key (did you mean 'num_kv_cache'?)" in _error(
        tmp_path, "stream: {num_kv_cahce: 6}\n")
    assert "modle: unknown key (did you mean 'model'?)" in _error(tmp_path, overrides=["modle.seed=1"])
    assert "unknown preset 'defualt' (did you mean 'default'?)" in _error(tmp_path, name="defualt")
    assert "did you mean" not in _error(tmp_path, overrides=["stream.zzz=1"])  # nothing near: the list alone


@pytest.mark.parametrize("typed", ["a cat: on a mat", "#red neon", "12:30", "[neon]", "yes"])
def test_a_text_key_takes_the_text_as_typed(typed):
    """`--set prompt.text=a cat: on a mat` was a YAML mapping (refused), `#red` a comment (no prompt), `12:30` the
    number 750: a text key takes what the user typed; quoting and null still read as YAML reads them."""
    assert load_config("tiny-random", [f"prompt.text={typed}"]).prompt.text == typed
    assert load_config("tiny-random", ["prompt.text='quoted: text'"]).prompt.text == "quoted: text"
    assert load_config("tiny-random", ["model.checkpoint=null"]).model.checkpoint is None
    with pytest.raises(ConfigError, match=r"stream\.mode: 'off' is not allowed; expected one of 'auto'"):
        load_config("tiny-random", ["stream.mode=off"])  # a choice: said with its choices, not as False
    assert load_config("tiny-random", ["stream.steps=[700]"]).stream.steps == [700]  # other keys: YAML


def test_a_prompt_and_a_lora_path_with_an_emoji_reach_a_launched_engine_s_config_whole(monkeypatch, tmp_path):
    """The player hands a launched engine its first prompt, and --lora its files, as `--set` YAML text: written
    ASCII-escaped, an emoji came back as two broken surrogate halves ("ink \\ud83c\\udfa8")."""
    from loom_live import host_bridge
    from loom_live.engine.host_overrides import lora_override
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    started = []

    class Launched:
        def __init__(self, cfg):
            started.append(cfg)

        def start(self):
            pass

    monkeypatch.setattr(host_bridge, "Bridge", Launched)
    Player(PlayerOptions(prompts=["ink 🎨"], config="tiny-random"))._start_engine()
    assert load_config("tiny-random", started[0].engine_overrides).prompt.text == "ink 🎨"
    look = str(tmp_path / "🎨 look.safetensors")
    assert [e.path for e in load_config("tiny-random", lora_override([f"{look}:0.5"])).lora] == [look]


@pytest.mark.parametrize(("sources", "named"), [(None, "--set"), (["overrides line 4"], "overrides line 4")])
def test_served_overrides_check_the_first_prompt_as_the_config_would_naming_its_source(sources, named):
    """The host's first prompt is checked where the live values are, so that its refusal names the override's
    source too (a ComfyUI node's line), not a config the user never wrote."""
    with pytest.raises(ConfigError, match=rf"^{named}: prompt.text: None is not allowed; expected a string$"):
        served_overrides(["prompt.text="], sources)
    assert served_overrides(["prompt.text=a cat: on a mat"], sources)[0] == ['prompt.text="a cat: on a mat"']


def test_check_overrides_refuses_what_load_config_refuses_naming_the_override_or_the_config(tmp_path):
    """check_overrides agrees with load_config (what an engine checks at its start) on each case, and names the
    override whose value is refused, or the config under the host's label when no override is to blame."""
    lines = ["noise.noise_scale=0.5", "stream.steps=[9999]"]
    sources = ["line 1", "line 2"]
    for overrides, said in [(lines, "line 2: stream.steps[0]: 9999 is not allowed"),
                            (lines[:1], None),
                            (["stream.steps=[700,"], "line 1: not valid YAML"),
                            (["model.family=edit", "model.preset=null"], "line 2: model.preset: None is not allowed")]:
        with pytest.raises(ConfigError) if said else contextlib.nullcontext() as refused:
            check_overrides("default", overrides, sources, "the node's overrides")
        if said is None:
            load_config("default", overrides)
            continue
        assert str(refused.value).startswith(said), str(refused.value)
        with pytest.raises(ConfigError):
            load_config("default", overrides)
    own = tmp_path / "own.yaml"
    own.write_text("stream: {steps: abc}\n")
    said = rf"^{re.escape(str(own))} \(with the node's overrides\): stream.steps: 'abc'"
    with pytest.raises(ConfigError, match=said):
        check_overrides(own, lines[:1], sources, "the node's overrides")  # the config's own value: no line blamed
