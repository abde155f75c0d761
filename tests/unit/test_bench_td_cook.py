"""The TouchDesigner cook benchmark's model engine: a config file of a preset on random weights that the
engine loads as `loom bench` would run it, and a refused name said in one line."""

from __future__ import annotations

import pytest

from benchmarks.bench_td_cook import model_config
from loom_live.engine.config import load_config


def test_a_preset_becomes_a_config_file_on_random_weights(tmp_path):
    cfg = load_config(str(model_config("wan2.1-1.3b", tmp_path)))
    assert cfg.model.preset == "wan2.1-1.3b" and cfg.model.random_weights and cfg.vae.random_weights
    assert cfg.prompt.encoder == "hash"  # no text encoder's weights to read
    assert cfg.resolution == load_config("wan2.1-1.3b").resolution  # the preset otherwise as shipped


def test_an_unknown_preset_is_refused_naming_the_presets(tmp_path):
    with pytest.raises(SystemExit, match=r"--config 'wan9': expected one of .*wan2.1-1.3b"):
        model_config("wan9", tmp_path)
