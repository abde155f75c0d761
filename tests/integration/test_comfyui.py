"""The ComfyUI node package, loaded the way ComfyUI loads a custom node folder, driving a real engine.

ComfyUI imports `custom_nodes/<folder>/__init__.py` by path under a module name of its own, reads
NODE_CLASS_MAPPINGS / NODE_DISPLAY_NAME_MAPPINGS, calls INPUT_TYPES to build the node UI, and calls
the FUNCTION method with keyword arguments. IMAGE is a float32 torch tensor [B, H, W, 3] in 0..1.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "plugin" / "comfyui"
COMFY_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "IMAGE", "LOOM_ENGINE"}


def _load_like_comfyui(folder: Path):
    name = str(folder).replace(".", "_x_")  # ComfyUI names the module after its path
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def nodes_pkg():
    module = _load_like_comfyui(PACKAGE_DIR)
    yield module
    module.nodes.ENGINES.close_all()


def _run(nodes_pkg, node: str, **kwargs):
    cls = nodes_pkg.NODE_CLASS_MAPPINGS[node]
    return getattr(cls(), cls.FUNCTION)(**kwargs)


def _engine(nodes_pkg, **settings):
    return _run(nodes_pkg, "LoomEngine", **{"config": "default", "transport": "shm", "fallback": "passthrough",
                                            **settings})



def test_mappings_and_input_types_are_what_comfyui_reads(nodes_pkg):
    classes, names = nodes_pkg.NODE_CLASS_MAPPINGS, nodes_pkg.NODE_DISPLAY_NAME_MAPPINGS
    assert set(classes) == {"LoomEngine", "LoomPrompt", "LoomStream"} == set(names)
    for cls in classes.values():
        assert isinstance(cls.CATEGORY, str) and callable(getattr(cls, cls.FUNCTION))
        assert isinstance(cls.RETURN_TYPES, tuple) and all(isinstance(t, str) for t in cls.RETURN_TYPES)
        spec = cls.INPUT_TYPES()
        assert set(spec) <= {"required", "optional", "hidden"} and "required" in spec
        for section in spec.values():
            for name, entry in section.items():
                kind = entry[0]
                assert isinstance(kind, list) or kind in COMFY_TYPES, (cls.__name__, name, kind)
                if isinstance(kind, list) or kind in ("INT", "FLOAT", "STRING", "BOOLEAN"):
                    assert "default" in entry[1], (cls.__name__, name)
                    if isinstance(kind, list):
                        assert entry[1]["default"] in kind


def test_registry_metadata():
    tomllib = pytest.importorskip("tomllib")
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


def _image_batch(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8).astype(np.float32) / 255.0)


def test_stream_returns_every_frame_in_order_passthrough(nodes_pkg):
    handle, status = _engine(nodes_pkg, passthrough=True)
    assert "engine" in status
    again, _ = _engine(nodes_pkg, passthrough=True)
    assert again is handle and len(nodes_pkg.nodes.ENGINES) == 1  # a re-run reuses the engine
    (handle,) = _run(nodes_pkg, "LoomPrompt", engine=handle, prompt="stained glass", steps=1, noise_scale=0.6,
                     motion_aware=False, transition_chunks=0)
    images = _image_batch(9, 48, 64)
    out, status = _run(nodes_pkg, "LoomStream", engine=handle, images=images)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == images.shape
    assert torch.equal(out, images)  # content exact: order kept, nothing lost or duplicated
    assert "running" in status
    session = _engine_session_stats(handle.bridge, lambda s: s.get("prompt") == "stained glass")
    assert session["params"] == {"steps": [700], "noise_scale": 0.6, "motion_aware": False}


def _engine_session_stats(bridge, ready, timeout_s: float = 10.0) -> dict:
    """The engine's own report (sent about once a second) once `ready(report)` holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        session = bridge.stats()["engine"].get("session") or {}
        if ready(session):
            return session
        time.sleep(0.1)
    raise AssertionError(f"engine never reported the expected state: {bridge.stats()['engine']}")


def test_prompt_node_refuses_bad_values(nodes_pkg):
    handle, _ = _engine(nodes_pkg, passthrough=True)
    with pytest.raises(ValueError, match="prompt is empty"):
        _run(nodes_pkg, "LoomPrompt", engine=handle, prompt="  ", steps=2, noise_scale=0.8, motion_aware=True,
             transition_chunks=4)
    with pytest.raises(ValueError, match="steps: 5 is not allowed"):
        _run(nodes_pkg, "LoomPrompt", engine=handle, prompt="x", steps=5, noise_scale=0.8, motion_aware=True,
             transition_chunks=4)


def test_stream_refuses_a_non_image(nodes_pkg):
    handle, _ = _engine(nodes_pkg, passthrough=True)
    with pytest.raises(ValueError, match="expected \\[B, H, W, 3\\]"):
        _run(nodes_pkg, "LoomStream", engine=handle, images=torch.zeros(2, 3, 16, 16))


def test_stream_through_the_embedded_model_on_cpu(nodes_pkg):
    handle, _ = _engine(nodes_pkg)
    images = _image_batch(9, 64, 64, seed=1)
    out, _ = _run(nodes_pkg, "LoomStream", engine=handle, images=images)
    assert out.shape == images.shape and out.dtype == torch.float32
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    assert not torch.equal(out, images)
