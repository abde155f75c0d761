"""The TouchDesigner operator's LoRA page: files loaded by the engine it starts, scales changed live, and
a file that cannot be loaded said on the component while the stream goes on. TouchDesigner's objects are
the stand-ins of tests/fakes/touchdesigner.py; the bridge and the engine process are real.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from loom_live.host_bridge.wire.params import LORA_DEFAULT_SCALE, LORA_SCALES
from loom_live.plugin.touchdesigner import osc_in_callbacks
from loom_live.plugin.touchdesigner.loom_ext import PAREXEC_PARS
from loom_live.plugin.touchdesigner.parameters import LORA_FILE_PARS, LORA_SCALE_PARS, PAGE_LORA
from tests.fakes.touchdesigner import InputTOP, configure, cook_until, make_component, running, td_texture

TINY_DIM = 128  # the tiny-random preset's DiT width


def _lora_file(path: Path, dim_in: int = TINY_DIM) -> Path:
    """A rank-2 LoRA on block 0's self-attention query, in the original Wan layout; `dim_in` other
    than the model's makes it a LoRA for another model size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.full((2, dim_in), 0.01),
               "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.full((TINY_DIM, 2), 0.01)}, str(path))
    return path


def _session(ext: Any) -> dict[str, Any]:
    return ext.bridge.stats()["engine"].get("session") or {}


def _cook_until_engine(script: Any, ext: Any, ready: Any, what: str) -> None:
    cook_until(script, lambda: ready(_session(ext)), what, timeout_s=20)


def test_the_lora_page_has_a_file_and_a_live_scale_per_slot():
    comp, _, _ = make_component(None)
    assert len(LORA_FILE_PARS) == LORA_SCALES.max_len  # as many slots as an engine loads LoRAs
    assert PAGE_LORA in [p.name for p in comp.customPages]
    for file, scale in zip(LORA_FILE_PARS, LORA_SCALE_PARS):
        f, s = getattr(comp.par, file), getattr(comp.par, scale)
        assert f.style == "File" and f.eval() == ""
        assert s.style == "Float" and s.eval() == LORA_DEFAULT_SCALE
        assert (s.min, s.max) == (LORA_SCALES.min, LORA_SCALES.ui_max) and s.clampMin and s.clampMax
        assert file in PAREXEC_PARS.split() and scale in PAREXEC_PARS.split()


def test_lora_files_load_at_start_scales_change_live_and_bad_slots_are_said(tmp_path):
    ink, film = _lora_file(tmp_path / "ink.safetensors"), _lora_file(tmp_path / "film.safetensors")
    comp, script, ext = make_component(InputTOP(td_texture(24, 32)))
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Lora1, comp.par.Lora1scale = str(ink), 0.8
    comp.par.Lora2 = str(film)
    comp.par.Lora3 = str(tmp_path / "missing.safetensors")
    comp.par.Lora4 = str(_lora_file(tmp_path / "other" / "ink.safetensors"))  # the same name as slot 1's
    comp.parexec_enabled = True
    comp.par.Active = True
    try:
        cook_until(script, lambda: running(comp), "engine running")
        assert ext.bridge.config.engine_args == ["--lora", f"{ink}:0.8", "--lora", f"{film}:1.0"]
        message = comp.par.Message.eval()
        assert "LoRA 3 not loaded" in message and "missing.safetensors: no such file" in message
        assert "LoRA 4 not loaded: LoRA 1 has a file named 'ink'" in message
        _cook_until_engine(script, ext, lambda s: s.get("params", {}).get("lora_scales") == {"ink": 0.8, "film": 1.0},
                           "the page's scales")
        pid = ext.bridge.stats()["engine_pid"]

        comp.par.Lora2scale = 0.25  # live: the same engine, the same stream
        _cook_until_engine(script, ext, lambda s: s["params"]["lora_scales"] == {"ink": 0.8, "film": 0.25},
                           "the new scale")
        dat = SimpleNamespace(parent=lambda: comp)  # OSC addresses a LoRA by name, as the player's does
        osc_in_callbacks.onReceiveOSC(dat, 0, "", b"", 0.0, "/loom/lora/scale", ["ink", 0.5], None)
        osc_in_callbacks.onReceiveOSC(dat, 0, "", b"", 0.0, "/loom/lora/scale", ["nobody", 0.5], None)  # ignored
        _cook_until_engine(script, ext, lambda s: s["params"]["lora_scales"] == {"ink": 0.5, "film": 0.25},
                           "the OSC scale")
        assert comp.par.Lora1scale.eval() == 0.5
        assert ext.bridge.stats()["engine_pid"] == pid and ext.bridge.status().restarts == 0

        comp.par.Lora2 = ""  # a file change restarts the engine with the page's files
        assert ext.bridge.config.engine_args == ["--lora", f"{ink}:0.5"]
    finally:
        comp.par.Active = False
    assert ext.WaitClosed()


@pytest.mark.slow  # two engines load the tiny model (about 10 s on two idle cores)
def test_a_lora_the_engine_refuses_is_left_out_and_the_stream_goes_on(tmp_path):
    """A LoRA for another model size is refused by the engine only (it takes the model's shapes): the
    component names the file and the engine's reason, and starts the engine again with the other LoRAs."""
    wrong = _lora_file(tmp_path / "wan14b.safetensors", dim_in=TINY_DIM + 8)
    good = _lora_file(tmp_path / "ink.safetensors")
    comp, script, ext = make_component(InputTOP(td_texture(24, 32)))
    comp.parexec_enabled = False
    comp.par.Enginepython, comp.par.Transport, comp.par.Config = sys.executable, "shm", "tiny-random"
    comp.par.Lora1, comp.par.Lora2 = str(wrong), str(good)
    comp.parexec_enabled = True
    comp.par.Active = True
    try:
        cook_until(script, lambda: ext.bridge is not None and comp.par.State.eval() == "running"
                   and "LoRA 1 not loaded" in comp.par.Message.eval(), "the engine running without LoRA 1", 60)
        message = comp.par.Message.eval()
        assert f"the engine refused it: {wrong}: shapes that do not fit this model" in message, message
        assert ext.bridge.config.engine_args == ["--lora", f"{good}:1.0"]
        time.sleep(0.2)
        script.cook()
        assert comp.par.State.eval() == "running" and "LoRA 1 not loaded" in comp.par.Message.eval()
        film = _lora_file(tmp_path / "film.safetensors")
        comp.par.Lora3 = str(film)  # another file, the same model: the refused one stays out
        assert ext.bridge.config.engine_args == ["--lora", f"{good}:1.0", "--lora", f"{film}:1.0"]
        assert "LoRA 1 not loaded, the engine refused it" in comp.par.Message.eval()
    finally:
        comp.par.Active = False
    assert ext.WaitClosed()
