"""The ComfyUI node package, loaded the way ComfyUI loads a custom node folder, driving a real engine.

ComfyUI imports `custom_nodes/<folder>/__init__.py` by path under a module name of its own, reads
NODE_CLASS_MAPPINGS / NODE_DISPLAY_NAME_MAPPINGS, calls INPUT_TYPES to build the node UI, and calls
the FUNCTION method with keyword arguments. IMAGE is a float32 torch tensor [B, H, W, 3] in 0..1.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.fakes.comfyui import PACKAGE_DIR, engine_node, image_batch, loaded_node_package, run_node
from tests.fakes.engines import engine_report

COMFY_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "IMAGE", "LOOM_ENGINE", "LOOM_LORAS"}


@pytest.fixture(scope="module")
def nodes_pkg():
    with loaded_node_package() as package:
        yield package


def test_mappings_and_input_types_are_what_comfyui_reads(nodes_pkg):
    classes, names = nodes_pkg.NODE_CLASS_MAPPINGS, nodes_pkg.NODE_DISPLAY_NAME_MAPPINGS
    assert set(classes) == {"LoomEngine", "LoomLora", "LoomPrompt", "LoomControl", "LoomStream"} == set(names)
    for cls in classes.values():
        assert isinstance(cls.CATEGORY, str) and callable(getattr(cls, cls.FUNCTION))
        assert isinstance(cls.RETURN_TYPES, tuple) and all(isinstance(t, str) for t in cls.RETURN_TYPES)
        spec = cls.INPUT_TYPES()
        assert set(spec) <= {"required", "optional", "hidden"} and "required" in spec
        # hidden inputs are filled by ComfyUI itself, named by its own words (the node's id: UNIQUE_ID)
        assert set(spec.get("hidden", {}).values()) <= {"UNIQUE_ID", "PROMPT", "EXTRA_PNGINFO"}
        for section in (spec["required"], spec.get("optional", {})):
            for name, entry in section.items():
                kind = entry[0]
                assert isinstance(kind, list) or kind in COMFY_TYPES, (cls.__name__, name, kind)
                if isinstance(kind, list) or kind in ("INT", "FLOAT", "STRING", "BOOLEAN"):
                    assert "default" in entry[1], (cls.__name__, name)
                    if isinstance(kind, list):
                        assert entry[1]["default"] in kind


def test_registry_metadata():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    meta = tomllib.loads((PACKAGE_DIR / "pyproject.toml").read_text())
    assert {"PublisherId", "DisplayName"} <= set(meta["tool"]["comfy"])
    assert meta["project"]["name"] and meta["project"]["version"].count(".") == 2
    assert "comfyui" not in meta["project"]["name"].lower()  # the registry's naming rule


def test_is_changed_live_stream_always_reruns_engine_only_on_new_settings(nodes_pkg):
    stream, engine = nodes_pkg.NODE_CLASS_MAPPINGS["LoomStream"], nodes_pkg.NODE_CLASS_MAPPINGS["LoomEngine"]
    mark = stream.IS_CHANGED(engine=None, images=None)
    assert math.isnan(mark) and mark != mark  # NaN never equals the last value: ComfyUI re-runs the node
    a = engine.IS_CHANGED(config="default", transport="shm", fallback="passthrough")
    assert a == engine.IS_CHANGED(config="default", transport="shm", fallback="passthrough")
    assert a != engine.IS_CHANGED(config="default", transport="tcp", fallback="passthrough")


def test_stream_returns_every_frame_in_order_passthrough(nodes_pkg):
    handle, status = engine_node(nodes_pkg, passthrough=True)
    assert "engine" in status
    again, _ = engine_node(nodes_pkg, passthrough=True)
    assert again is handle and len(nodes_pkg.nodes.ENGINES) == 1  # a re-run reuses the engine
    (handle,) = run_node(nodes_pkg, "LoomPrompt", engine=handle, prompt="stained glass", steps=1, noise_scale=0.6,
                     motion_aware=False, transition_chunks=0)
    images = image_batch(9, 48, 64)
    out, status = run_node(nodes_pkg, "LoomStream", engine=handle, images=images)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == images.shape
    assert torch.equal(out, images)  # content exact: order kept, nothing lost or duplicated
    assert "running" in status
    report = engine_report(handle.bridge, lambda r: (r.get("session") or {}).get("prompt") == "stained glass")
    session = report["session"]
    assert session["params"] == {"steps": [700], "noise_scale": 0.6, "motion_aware": False}


def test_prompt_node_refuses_bad_values(nodes_pkg):
    """An empty prompt in the words of the engine's model family (it said so when ready): an edit engine's prompt
    is an instruction, and the node asked for "a few words describing the style"."""
    for config, takes in (("default", "a few words describing the style"),
                          ("edit-tiny", "an instruction, such as 'make it a watercolor painting'")):
        handle, _ = engine_node(nodes_pkg, passthrough=True, config=config)
        with pytest.raises(ValueError, match=f"Loom Prompt: the prompt is empty; give {takes}$"):
            run_node(nodes_pkg, "LoomPrompt", engine=handle, prompt="  ", steps=2, noise_scale=0.8,
                     motion_aware=True, transition_chunks=4)
    with pytest.raises(ValueError, match="steps: 5 is not allowed"):
        run_node(nodes_pkg, "LoomPrompt", engine=handle, prompt="x", steps=5, noise_scale=0.8, motion_aware=True,
             transition_chunks=4)


def test_stream_refuses_a_non_image(nodes_pkg):
    handle, _ = engine_node(nodes_pkg, passthrough=True)
    with pytest.raises(ValueError, match="expected \\[B, H, W, 3\\]"):
        run_node(nodes_pkg, "LoomStream", engine=handle, images=torch.zeros(2, 3, 16, 16))


# the engine's own settings (its config's), none of them the nodes' defaults
OWN = ("prompt.text=ink wash\nstream.steps=[600]\nnoise.noise_scale=0.5\nnoise.motion_aware=false\n"
       "control.context_scale=0.7")


def _engine_session(handle) -> dict:
    """What the pass-through engine was told, after a Stream run (its flush refreshed the session's stats)."""
    return handle.bridge.engine_report(refresh=True)["session"]


def test_a_run_without_a_prompt_node_streams_on_the_engine_s_own_prompt_not_an_earlier_run_s(nodes_pkg):
    """Engine -> Stream, then Engine -> Prompt -> Stream, then Engine -> Stream again (the Prompt node bypassed
    or removed): the third run is on the prompt the engine started with, its config's, as the first was, not
    on the second run's."""
    from loom_live.engine.config import load_config

    handle, _ = engine_node(nodes_pkg, passthrough=True, overrides=OWN)
    try:
        start = load_config("default", OWN.splitlines()).start_settings()
        assert handle.bridge.engine_start() == start  # what the engine's ready message said it starts on
        images = image_batch(5, 16, 24)
        out, _ = run_node(nodes_pkg, "LoomStream", engine=handle, images=images)
        assert torch.equal(out, images) and _engine_session(handle)["prompts_received"] == 0  # the config's own
        (prompted,) = run_node(nodes_pkg, "LoomPrompt", engine=handle, prompt="a watercolor of a dragon", steps=2,
                               noise_scale=0.8, motion_aware=True, transition_chunks=4)
        run_node(nodes_pkg, "LoomStream", engine=prompted, images=images)
        assert _engine_session(handle)["prompt"] == "a watercolor of a dragon"
        out, _ = run_node(nodes_pkg, "LoomStream", engine=handle, images=images)
        assert torch.equal(out, images) and _engine_session(handle)["prompt"] == "ink wash"
        assert handle.bridge.wanted.prompt.text == "ink wash"
    finally:
        nodes_pkg.nodes.ENGINES.close(handle.key)


def test_parameters_no_node_on_the_wire_sets_go_back_to_the_engine_s_own(nodes_pkg):
    """A Prompt and a Control node change steps, noise and the control scale; a later run whose wire has only
    the Prompt node streams on the Control node's parameters of the config again, and one without either on
    all of the config's, whatever the earlier runs set."""
    from loom_live.engine.config import load_config

    handle, _ = engine_node(nodes_pkg, passthrough=True, overrides=OWN)
    try:
        own = load_config("default", OWN.splitlines()).start_settings()["params"]
        images = image_batch(5, 16, 24)
        (prompted,) = run_node(nodes_pkg, "LoomPrompt", engine=handle, prompt="a watercolor of a dragon", steps=1,
                               noise_scale=0.3, motion_aware=True, transition_chunks=4)
        (controlled,) = run_node(nodes_pkg, "LoomControl", engine=prompted, control_source="edges",
                                 context_scale=0.2)
        run_node(nodes_pkg, "LoomStream", engine=controlled, images=images)
        assert _engine_session(handle)["params"] == {"steps": [700], "noise_scale": 0.3, "motion_aware": True,
                                                     "control_source": "edges", "context_scale": 0.2}
        run_node(nodes_pkg, "LoomStream", engine=prompted, images=images)  # the Control node bypassed
        assert _engine_session(handle)["params"] == {"steps": [700], "noise_scale": 0.3, "motion_aware": True,
                                                     "control_source": "edges", "context_scale": 0.7}
        out, _ = run_node(nodes_pkg, "LoomStream", engine=handle, images=images)  # and the Prompt node
        session = _engine_session(handle)
        assert torch.equal(out, images) and session["prompt"] == "ink wash"
        assert session["params"] == {"steps": [600], "noise_scale": 0.5, "motion_aware": False,
                                     "control_source": "edges", "context_scale": 0.7}
        assert session["params"] == {name: own[name] for name in session["params"]}
    finally:
        nodes_pkg.nodes.ENGINES.close(handle.key)
