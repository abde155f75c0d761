"""The Loom LoRA node and the Engine node's LoRAs, loaded the way ComfyUI loads the node package: a chain
of LoRA nodes, files from ComfyUI's loras folder or a path, strengths changed live on the running engine,
files changed by a restart, and a LoRA the engine refuses named in the run's error.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from loom_live.host_bridge.wire.params import LORA_DEFAULT_SCALE, LORA_SCALES
from tests.fakes.comfyui import engine_node, image_batch, loaded_node_package, run_node
from tests.fakes.engines import engine_report

TINY_DIM = 128  # the tiny-random preset's DiT width


@pytest.fixture(scope="module")
def nodes_pkg():
    with loaded_node_package() as package:
        yield package


def _lora_file(path: Path, dim_in: int = TINY_DIM) -> Path:
    """A rank-2 LoRA on block 0's query (original Wan layout); another `dim_in` is another model size's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.full((2, dim_in), 0.01),
               "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.full((TINY_DIM, 2), 0.01)}, str(path))
    return path


def _lora(nodes_pkg, path: Path | str = "", strength: float = 1.0, loras=None, lora_name: str | None = None):
    name = lora_name or nodes_pkg.nodes.NO_LORA_FILE
    return run_node(nodes_pkg, "LoomLora", lora_name=name, strength=strength, path=str(path), loras=loras)[0]


def test_lora_nodes_list_the_loras_folder_chain_and_refuse_what_cannot_load(nodes_pkg, tmp_path, monkeypatch):
    folder = tmp_path / "models" / "loras"
    ink = _lora_file(folder / "styles" / "ink.safetensors")
    film = _lora_file(tmp_path / "elsewhere" / "film.safetensors")
    folder_paths = types.ModuleType("folder_paths")  # ComfyUI's module, as its own LoRA loader uses it
    folder_paths.get_filename_list = lambda kind: ["styles/ink.safetensors"] if kind == "loras" else []
    folder_paths.get_full_path = lambda kind, name: str(folder / name) if (folder / name).is_file() else None
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)

    node = nodes_pkg.NODE_CLASS_MAPPINGS["LoomLora"]
    required = node.INPUT_TYPES()["required"]
    assert required["lora_name"][0] == [nodes_pkg.nodes.NO_LORA_FILE, "styles/ink.safetensors"]
    strength = required["strength"][1]  # the widget's range is the live-parameter schema's
    assert (strength["default"], strength["min"], strength["max"], strength["step"]) == \
        (LORA_DEFAULT_SCALE, LORA_SCALES.min, LORA_SCALES.ui_max, LORA_SCALES.ui_step)
    one = _lora(nodes_pkg, lora_name="styles/ink.safetensors", strength=0.8)
    two = _lora(nodes_pkg, film, 0.5, loras=one)  # a path, chained after the folder's file
    assert one == ((str(ink), 0.8),) and two == ((str(ink), 0.8), (str(film), 0.5))

    with pytest.raises(ValueError, match="Loom LoRA: .*both named 'ink'.*rename one"):
        _lora(nodes_pkg, _lora_file(tmp_path / "b" / "ink.safetensors"), loras=two)
    with pytest.raises(ValueError, match="Loom LoRA: .*missing.safetensors: no such file"):
        _lora(nodes_pkg, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match=r"lora_scales: .*numbers in \[-4, 4\]"):
        _lora(nodes_pkg, film, 9.0)
    with pytest.raises(ValueError, match="pick a file in lora_name .* or give a path"):
        _lora(nodes_pkg)
    monkeypatch.delitem(sys.modules, "folder_paths")  # outside ComfyUI: a path only
    assert node.INPUT_TYPES()["required"]["lora_name"][0] == [nodes_pkg.nodes.NO_LORA_FILE]


def test_strengths_change_live_and_files_restart_the_engine(nodes_pkg, tmp_path):
    ink, film = _lora_file(tmp_path / "ink.safetensors"), _lora_file(tmp_path / "film.safetensors")
    engine = nodes_pkg.NODE_CLASS_MAPPINGS["LoomEngine"]
    engines = nodes_pkg.nodes.ENGINES
    both = _lora(nodes_pkg, film, 1.0, loras=_lora(nodes_pkg, ink, 0.8))
    try:
        handle, _ = engine_node(nodes_pkg, passthrough=True, loras=both, unique_id="3")  # ComfyUI's node id
        assert handle.bridge.config.engine_args == ["--lora", f"{ink}:0.8", "--lora", f"{film}:1.0"]
        images = image_batch(5, 32, 32)
        out, _ = run_node(nodes_pkg, "LoomStream", engine=handle, images=images)
        assert torch.equal(out, images)
        pid = handle.bridge.stats()["engine_pid"]

        weaker = _lora(nodes_pkg, film, 0.3, loras=_lora(nodes_pkg, ink, 0.8))
        settings = {"config": "default", "transport": "shm", "fallback": "passthrough", "passthrough": True}
        assert engine.IS_CHANGED(**settings, loras=weaker) != engine.IS_CHANGED(**settings, loras=both)
        again, _ = engine_node(nodes_pkg, passthrough=True, loras=weaker, unique_id="3")
        assert again.bridge is handle.bridge and handle.bridge.stats()["engine_pid"] == pid  # live: no restart
        engine_report(handle.bridge, lambda r: (r.get("session") or {}).get("params", {}).get("lora_scales")
                      == {"ink": 0.8, "film": 0.3})  # raises unless the engine reports the new strengths

        only_ink = _lora(nodes_pkg, ink, 0.8)
        other, _ = engine_node(nodes_pkg, passthrough=True, loras=only_ink, unique_id="3")  # other files: a restart
        assert other.bridge is not handle.bridge and len(engines) == 1
        assert handle.bridge.status().state == "stopped"
        assert other.bridge.config.engine_args == ["--lora", f"{ink}:0.8"]

        # two Engine nodes with different files (an A/B comparison) each keep their engine
        first, _ = engine_node(nodes_pkg, passthrough=True, loras=only_ink, unique_id="7")
        second, _ = engine_node(nodes_pkg, passthrough=True, loras=both, unique_id="8")
        assert first.bridge is other.bridge and len(engines) == 2 and first.users == {"3", "7"}
        assert engine_node(nodes_pkg, passthrough=True, loras=only_ink, unique_id="7")[0].bridge is first.bridge
        assert first.bridge.status().state != "stopped" and second.bridge.status().state != "stopped"
    finally:
        engines.close_all()


def test_an_ended_engine_with_loras_makes_its_engine_node_run_again(nodes_pkg, tmp_path):
    """ComfyUI calls IS_CHANGED with linked inputs as None (the LoRA chain among them): an engine started with
    LoRAs that has ended is still found, by the node that uses it, so the next queue run starts a fresh one."""
    loras = _lora(nodes_pkg, _lora_file(tmp_path / "ink.safetensors"), 0.8)
    engine = nodes_pkg.NODE_CLASS_MAPPINGS["LoomEngine"]
    settings = {"config": "default", "transport": "shm", "fallback": "passthrough", "passthrough": True}
    try:
        handle, _ = engine_node(nodes_pkg, passthrough=True, loras=loras, unique_id="3")
        mark = engine.IS_CHANGED(**settings, loras=None, unique_id="3")
        handle.bridge.close()  # ended for good (as one that refuses a LoRA file changed since)
        assert engine.IS_CHANGED(**settings, loras=None, unique_id="3") == f"{mark}:ended"
        assert engine.IS_CHANGED(**settings, loras=None, unique_id="4") == mark  # another node's engine: as it was
    finally:
        nodes_pkg.nodes.ENGINES.close_all()


def test_a_lora_the_engine_refuses_fails_the_engine_node_with_the_file_and_the_reason(nodes_pkg, tmp_path):
    wrong = _lora(nodes_pkg, _lora_file(tmp_path / "wan14b.safetensors", dim_in=TINY_DIM + 8))
    engines = nodes_pkg.nodes.ENGINES
    try:
        with pytest.raises(RuntimeError, match="^Loom Engine: the engine refused the LoRA 'wan14b': .*wan14b."
                                               "safetensors: shapes that do not fit this model .*Remove it from "
                                               "the Loom LoRA chain"):
            engine_node(nodes_pkg, config="tiny-random", loras=wrong)
        assert len(engines) == 0  # stopped: not failing again and again
    finally:
        engines.close_all()
