"""The node package's example workflows (ComfyUI's `example_workflows/`, shown in its template browser),
run the way ComfyUI runs a queued prompt, with the embedded model on the CPU: converted to the API format
as the frontend does, nodes in ComfyUI's order, outputs cached between queue runs. The video loader and
Save Video are ComfyUI's core nodes; they stand in here as functions of their inputs (the README's
ComfyUI section records a run in a real ComfyUI).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.fakes.comfyui import EXAMPLES_DIR, WorkflowRunner, api_prompt, image_batch, loaded_node_package
from tests.fakes.engines import wait_until

CORE_NODES = {"LoadVideo": ("VIDEO",), "GetVideoComponents": ("IMAGE", "AUDIO", "FLOAT"), "CreateVideo": ("VIDEO",),
              "SaveVideo": ()}
SMALL = "resolution.width=32\nresolution.height=32"  # the embedded model at a small size: a fast CPU test


@pytest.fixture(scope="module")
def nodes_pkg():
    with loaded_node_package() as package:
        yield package


def _workflow(name: str) -> dict:
    return json.loads((EXAMPLES_DIR / name).read_text())


def _add_branch(prompt: dict, name: str, engine: list) -> None:
    """Another Loom Stream -> Create Video -> Save Video branch: its Stream node (`{name}-stream`) streams the
    images the prompt's own Stream node streams, on `engine` ([node id, output slot])."""
    stream = next(n for n in prompt.values() if n["class_type"] == "LoomStream")
    create = next(n for n in prompt.values() if n["class_type"] == "CreateVideo")
    prompt[f"{name}-stream"] = {"class_type": "LoomStream", "inputs": {**stream["inputs"], "engine": engine}}
    prompt[f"{name}-create"] = {"class_type": "CreateVideo",
                                "inputs": {**create["inputs"], "images": [f"{name}-stream", 0]}}
    prompt[f"{name}-save"] = {"class_type": "SaveVideo", "inputs": {"video": [f"{name}-create", 0]}}


def _renumbered(prompt: dict, prefix: str) -> dict:
    """The prompt with `prefix` before each node id: another workflow, whose nodes have ids of their own."""
    return {prefix + node_id: {**node, "inputs": {k: [prefix + v[0], v[1]] if isinstance(v, list) else v
                                                  for k, v in node["inputs"].items()}}
            for node_id, node in prompt.items()}


def _runner(nodes_pkg, frames: torch.Tensor, saved: list) -> WorkflowRunner:
    return WorkflowRunner(nodes_pkg, {
        "LoadVideo": lambda file: ({"file": file},),
        "GetVideoComponents": lambda video: (frames, None, 24.0),
        "CreateVideo": lambda images, fps, audio=None: ({"images": images, "fps": fps},),
        "SaveVideo": lambda video, **_: saved.append(video["images"]) or (),
    })


@pytest.mark.parametrize("name", ["loom_video_restyle.json", "loom_lora_restyle.json"])
def test_the_example_workflows_wire_loom_and_core_nodes_as_their_inputs_declare(nodes_pkg, name):
    workflow = _workflow(name)
    classes = nodes_pkg.NODE_CLASS_MAPPINGS
    returns = {str(n["id"]): classes[n["type"]].RETURN_TYPES if n["type"] in classes else CORE_NODES[n["type"]]
               for n in workflow["nodes"]}
    for link_id, origin, slot, _, _, kind in workflow["links"]:
        assert returns[str(origin)][slot] == kind, (link_id, kind)
    for node_id, node in api_prompt(workflow).items():
        cls = classes.get(node["class_type"])
        if cls is None:
            continue
        spec = cls.INPUT_TYPES()
        declared = {**spec["required"], **spec.get("optional", {})}
        assert set(node["inputs"]) <= set(declared) and set(spec["required"]) <= set(node["inputs"]), node_id
        for key, value in node["inputs"].items():
            kind = declared[key][0]
            if isinstance(kind, list):
                assert value in kind, (node_id, key, value)


def test_the_video_restyle_example_runs_and_a_requeued_run_with_a_new_prompt_equals_a_fresh_one(nodes_pkg):
    """ComfyUI keeps the Engine node's output (one engine) and runs the Prompt and Stream nodes again when the
    prompt changes. A run after another prompt's run returns what the first run of a fresh engine returned:
    a queued run is a function of its inputs (no blend from the last run's prompt, no stream state)."""
    prompt = api_prompt(_workflow("loom_video_restyle.json"))
    engine_id = next(k for k, n in prompt.items() if n["class_type"] == "LoomEngine")
    prompt_id = next(k for k, n in prompt.items() if n["class_type"] == "LoomPrompt")
    prompt[engine_id]["inputs"]["overrides"] = SMALL
    nodes_pkg.nodes.ENGINES.close_all()
    frames, saved = image_batch(4, 32, 32, seed=7), []
    runner = _runner(nodes_pkg, frames, saved)
    outputs = []
    for text in ("thermal camera", "pencil sketch", "thermal camera"):
        prompt[prompt_id]["inputs"]["prompt"] = text
        runner.queue(prompt)
        assert prompt_id in runner.ran and (engine_id in runner.ran) == (not outputs)  # one engine, kept
        outputs.append(saved[-1])
    fresh, other, requeued = outputs
    assert fresh.shape == frames.shape and fresh.dtype == torch.float32  # an IMAGE batch, one frame per frame
    assert float(fresh.min()) >= 0.0 and float(fresh.max()) <= 1.0
    assert not torch.equal(fresh, frames) and not torch.equal(other, fresh)  # restyled, by the prompt
    assert torch.equal(requeued, fresh), f"max difference {float((requeued - fresh).abs().max()) * 255:.1f} levels"


def test_two_branches_on_one_engine_each_stream_on_their_own_prompt_when_requeued(nodes_pkg):
    """An A/B of two prompts: one Engine node feeds two Prompt -> Stream branches. Queued again with nothing
    changed, ComfyUI keeps both Prompt nodes' outputs and runs only the Stream nodes: each branch must still
    stream on its own prompt, not on whichever Prompt node ran last."""
    prompt = api_prompt(_workflow("loom_video_restyle.json"))
    engine_id = next(k for k, n in prompt.items() if n["class_type"] == "LoomEngine")
    prompt_id = next(k for k, n in prompt.items() if n["class_type"] == "LoomPrompt")
    stream_id = next(k for k, n in prompt.items() if n["class_type"] == "LoomStream")
    prompt[engine_id]["inputs"]["overrides"] = SMALL
    prompt[prompt_id]["inputs"]["prompt"] = "thermal camera"
    prompt["b1"] = {"class_type": "LoomPrompt", "inputs": {**prompt[prompt_id]["inputs"], "prompt": "pencil sketch"}}
    _add_branch(prompt, "b", ["b1", 0])
    nodes_pkg.nodes.ENGINES.close_all()
    frames, saved = image_batch(4, 32, 32, seed=7), []
    runner = _runner(nodes_pkg, frames, saved)
    runs = []
    for _ in range(2):
        runner.queue(prompt)
        by_branch = dict(zip(("a", "b"), saved[-2:])) if runner.ran.index(stream_id) < runner.ran.index("b-stream") \
            else dict(zip(("b", "a"), saved[-2:]))
        runs.append(by_branch)
    assert prompt_id not in runner.ran and "b1" not in runner.ran and {stream_id, "b-stream"} <= set(runner.ran)
    assert not torch.equal(runs[0]["a"], runs[0]["b"])  # two prompts, two looks
    for branch in ("a", "b"):
        assert torch.equal(runs[1][branch], runs[0][branch]), branch


def test_editing_the_engine_node_leaves_one_engine(nodes_pkg):
    """Each edit of the Engine node's settings starts the engine of the new settings; the one it used before
    is stopped, unless another Engine node uses it."""
    prompt = api_prompt(_workflow("loom_video_restyle.json"))
    engine_id = next(k for k, n in prompt.items() if n["class_type"] == "LoomEngine")
    prompt[engine_id]["inputs"]["passthrough"] = True
    engines = nodes_pkg.nodes.ENGINES
    engines.close_all()
    frames, saved = image_batch(3, 16, 16), []
    runner = _runner(nodes_pkg, frames, saved)
    runner.queue(prompt)
    (first,) = engines._engines.values()
    for fallback in ("last", "passthrough"):  # two edits
        prompt[engine_id]["inputs"]["fallback"] = fallback
        runner.queue(prompt)
        assert engine_id in runner.ran and len(engines) == 1 and torch.equal(saved[-1], frames)
    assert first.bridge.status().state == "stopped"
    # another Engine node with the same settings shares the engine; it stays while one of them uses it
    other = {k: v for k, v in prompt.items()}
    other["99"] = {"class_type": "LoomEngine", "inputs": dict(prompt[engine_id]["inputs"])}
    runner.queue(other)
    shared = next(iter(engines._engines.values()))
    assert len(engines) == 1 and shared.users == {engine_id, "99"}
    prompt[engine_id]["inputs"]["fallback"] = "last"  # in `other` too
    runner.queue(other)
    assert len(engines) == 2 and wait_until(lambda: shared.bridge.status().state == "running", 5)


def test_an_engine_started_for_a_workflow_closes_those_it_does_not_use(nodes_pkg, caplog):
    """Two workflows whose Engine nodes have other settings, queued in turn (or an Engine node deleted and
    another added): each engine started closes the one the queued workflow does not use, and says so in the
    log, instead of one model per workflow staying on the GPU until ComfyUI exits. The first workflow queued
    again runs its Engine node again (ComfyUI kept its output, the closed engine) and streams on a fresh
    engine; queued once more, it keeps that one."""
    first = api_prompt(_workflow("loom_video_restyle.json"))
    engine_id = next(k for k, n in first.items() if n["class_type"] == "LoomEngine")
    first[engine_id]["inputs"]["passthrough"] = True
    second = _renumbered(first, "w2-")
    second[f"w2-{engine_id}"]["inputs"]["fallback"] = "last"  # other settings: another engine
    engines = nodes_pkg.nodes.ENGINES
    engines.close_all()
    caplog.set_level(logging.INFO)
    frames, saved = image_batch(3, 16, 16), []
    runner = _runner(nodes_pkg, frames, saved)
    runner.queue(first)
    (a,) = engines._engines.values()
    runner.queue(second)
    (b,) = engines._engines.values()
    assert b is not a and a.bridge.status().state == "stopped" and torch.equal(saved[-1], frames)
    runner.queue(first)
    (again,) = engines._engines.values()
    assert engine_id in runner.ran and again is not a and again is not b and torch.equal(saved[-1], frames)
    assert b.bridge.status().state == "stopped"
    runner.queue(first)
    (kept,) = engines._engines.values()
    assert kept is again and again.bridge.status().state == "running"
    assert torch.equal(saved[-1], frames)
    closed = [r for r in caplog.records if "no Engine node of the queued workflow uses it" in r.getMessage()]
    assert [r.levelno for r in closed] == [logging.INFO] * 2
    assert f"(Engine nodes: {engine_id})" in closed[0].getMessage()
    assert f"(Engine nodes: w2-{engine_id})" in closed[1].getMessage()


def test_a_workflow_s_own_engines_stay_when_it_starts_one(nodes_pkg):
    """One workflow with two Engine nodes of other settings (an A/B of two configs): the second engine's start
    keeps the first, which the workflow uses, and queued again the workflow reuses both, its Engine nodes'
    outputs kept."""
    prompt = api_prompt(_workflow("loom_video_restyle.json"))
    engine_id = next(k for k, n in prompt.items() if n["class_type"] == "LoomEngine")
    prompt[engine_id]["inputs"]["passthrough"] = True
    prompt["b-engine"] = {"class_type": "LoomEngine", "inputs": {**prompt[engine_id]["inputs"], "fallback": "last"}}
    _add_branch(prompt, "b", ["b-engine", 0])
    engines = nodes_pkg.nodes.ENGINES
    engines.close_all()
    frames, saved = image_batch(3, 16, 16), []
    runner = _runner(nodes_pkg, frames, saved)
    runner.queue(prompt)
    bridges = [h.bridge for h in engines._engines.values()]
    assert len(bridges) == 2 and {engine_id, "b-engine"} <= set(runner.ran)
    runner.queue(prompt)
    assert [h.bridge for h in engines._engines.values()] == bridges and not {engine_id, "b-engine"} & set(runner.ran)
    assert all(bridge.status().state == "running" for bridge in bridges)
    assert len(saved) == 4 and all(torch.equal(images, frames) for images in saved)
