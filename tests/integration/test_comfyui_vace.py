"""The ComfyUI nodes' VACE inputs, loaded as ComfyUI loads them, driving a real (pass-through) engine that
records what arrives: the Loom Control node's source, scale and reference image, and the Stream node's
control video beside the images, with the control frames that do not fit counted and said."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fakes.comfyui import OutputList, engine_node, image_batch, loaded_node_package, run_node


@pytest.fixture(scope="module")
def nodes_pkg():
    with loaded_node_package() as package:
        yield package


def recorded(handle) -> dict:
    handle.bridge.set_params(noise_scale=0.5, wait=True)  # an answered request refreshes the session's stats
    return handle.bridge.engine_report(refresh=True)["session"]


def as_uint8(images: torch.Tensor) -> np.ndarray:
    return np.round(images.numpy() * 255).astype(np.uint8)


def test_control_node_sets_source_scale_and_reference_and_stream_sends_the_control_video(nodes_pkg):
    handle, _ = engine_node(nodes_pkg, passthrough=True)
    reference = image_batch(2, 20, 24, seed=7)
    (handle,) = run_node(nodes_pkg, "LoomControl", engine=handle, control_source="video", context_scale=0.6,
                         reference=reference)
    session = recorded(handle)
    assert session["params"]["control_source"] == "video" and session["params"]["context_scale"] == 0.6
    assert session["control"]["reference"] == [20, 24, 3]
    assert session["control"]["reference_sum"] == int(as_uint8(reference[0]).astype(np.int64).sum())
    images, control = image_batch(5, 16, 24, seed=1), image_batch(5, 16, 24, seed=2)
    out, status = run_node(nodes_pkg, "LoomStream", engine=handle, images=images, control=control)
    assert torch.equal(out, images) and "control:" not in status
    report = recorded(handle)["control"]
    assert report["frames"] == 5 and report["sum"] == int(as_uint8(control).astype(np.int64).sum())
    # a control video of another size: every frame goes on, the status says they were refused
    out, status = run_node(nodes_pkg, "LoomStream", engine=handle, images=images, control=image_batch(5, 8, 8))
    assert torch.equal(out, images) and "control: 5 frame(s) refused" in status
    out, status = run_node(nodes_pkg, "LoomStream", engine=handle, images=images, control=control[:3])
    assert torch.equal(out, images) and "2 frame(s) without one" in status
    # without a reference input, the reference this node set before is cleared (a queued run is its inputs)
    run_node(nodes_pkg, "LoomControl", engine=handle, control_source="edges", context_scale=1.0)
    assert recorded(handle)["control"]["reference"] is None


def test_a_run_without_a_control_node_streams_without_the_reference_an_earlier_run_set(nodes_pkg):
    """Engine -> Control (a reference) -> Stream, then Engine -> Stream (the Control node bypassed or removed):
    the second run streams without a reference, as a first run without a Control node does, not on the
    first run's (its source and scale went back to the engine's own already)."""
    handle, _ = engine_node(nodes_pkg, passthrough=True)
    (controlled,) = run_node(nodes_pkg, "LoomControl", engine=handle, control_source="edges", context_scale=0.6,
                             reference=image_batch(1, 20, 24, seed=7))
    images = image_batch(3, 16, 24, seed=1)
    run_node(nodes_pkg, "LoomStream", engine=controlled, images=images)
    assert recorded(handle)["control"]["reference"] == [20, 24, 3]
    out, _ = run_node(nodes_pkg, "LoomStream", engine=handle, images=images)
    assert torch.equal(out, images) and recorded(handle)["control"]["reference"] is None
    assert handle.bridge.wanted.reference is None  # nor told a fresh engine, should this one restart


def test_control_node_refuses_bad_values_in_words(nodes_pkg):
    handle, _ = engine_node(nodes_pkg, passthrough=True)
    with pytest.raises(ValueError, match=r"Loom Control: context_scale: .*\[0, 2\]"):
        run_node(nodes_pkg, "LoomControl", engine=handle, control_source="edges", context_scale=5.0)
    with pytest.raises(ValueError, match="Loom Control: control_source: 'scribble'"):
        run_node(nodes_pkg, "LoomControl", engine=handle, control_source="scribble", context_scale=1.0)
    with pytest.raises(ValueError, match="the image batch is empty"):
        run_node(nodes_pkg, "LoomControl", engine=handle, control_source="edges", context_scale=1.0,
                 reference=torch.zeros(0, 8, 8, 3))


def test_a_bad_control_video_is_refused_naming_the_control_input(nodes_pkg):
    """The refusal named the images input (which was fine) when the control video was empty or of two sizes."""
    handle, _ = engine_node(nodes_pkg, passthrough=True)
    images = image_batch(2, 8, 8)
    with pytest.raises(ValueError, match=r"^Loom Stream: control: the image batch is empty \(0 frames\)"):
        run_node(nodes_pkg, "LoomStream", engine=handle, images=images, control=torch.zeros(0, 8, 8, 3))
    with pytest.raises(ValueError, match=r"^Loom Stream: control: the images come as a list of 2 in 2 sizes"):
        run_node(nodes_pkg, "LoomStream", engine=handle, images=images,
                 control=OutputList([image_batch(1, 8, 8), image_batch(1, 4, 4)]))


def test_a_refused_control_video_is_not_said_again_in_a_later_run_s_status(nodes_pkg):
    """The bridge keeps its last remark: a run with a fitting control video said the last run's refusal."""
    handle, _ = engine_node(nodes_pkg, passthrough=True)
    images = image_batch(3, 16, 24, seed=1)
    _, status = run_node(nodes_pkg, "LoomStream", engine=handle, images=images, control=image_batch(3, 8, 8))
    assert "control: 3 frame(s) refused" in status
    _, status = run_node(nodes_pkg, "LoomStream", engine=handle, images=images, control=image_batch(3, 16, 24))
    assert "refused" not in status, status
