"""ComfyUI's side of a custom node, for the node package tests: loading the package the way ComfyUI
loads a custom node folder, calling a node the way a workflow does, IMAGE batches, and the interrupt
flag of `comfy.model_management` that ComfyUI's Cancel sets.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "plugin" / "comfyui"


def _module_names(folder: Path) -> tuple[str, str]:
    name = str(folder).replace(".", "_x_")  # ComfyUI names the module after its path
    return name, name + ".nodes"


@contextmanager
def loaded_node_package(folder: Path = PACKAGE_DIR) -> Iterator[types.ModuleType]:
    """Import `custom_nodes/<folder>/__init__.py` by path under ComfyUI's module name; on exit close the
    engines it started and leave no trace in sys.modules (else a later load's relative import would
    find the old `nodes`)."""
    names = _module_names(folder)
    for name in names:
        sys.modules.pop(name, None)
    spec = importlib.util.spec_from_file_location(names[0], folder / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[names[0]] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        nodes = getattr(module, "nodes", None)
        if nodes is not None:
            nodes.ENGINES.close_all()
        for name in names:
            sys.modules.pop(name, None)


class OutputList(list):
    """The values of an output a node marks OUTPUT_IS_LIST (a folder loader's images): ComfyUI hands a node
    that marks INPUT_IS_LIST the whole list, and calls any other node once per item."""


def run_node(package: types.ModuleType, node: str, **kwargs: Any) -> Any:
    """What ComfyUI does for one node of a workflow: instantiate the class, call its FUNCTION by keyword;
    a node that marks INPUT_IS_LIST gets every input as a list (one item unless an `OutputList`)."""
    cls = package.NODE_CLASS_MAPPINGS[node]
    if getattr(cls, "INPUT_IS_LIST", False):
        kwargs = {k: v if isinstance(v, OutputList) else [v] for k, v in kwargs.items()}
    return getattr(cls(), cls.FUNCTION)(**kwargs)


def engine_node(package: types.ModuleType, **settings: Any) -> Any:
    """The Loom Engine node with the defaults a test wants (shm, pass-through fallback) and `settings`."""
    return run_node(package, "LoomEngine", **{"config": "default", "transport": "shm", "fallback": "passthrough",
                                               **settings})


def image_batch(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """A ComfyUI IMAGE: float32 [B, H, W, 3] in 0..1, values on the uint8 grid so a round trip is exact."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8).astype(np.float32) / 255.0)


class ComfyInterrupt(types.ModuleType):
    """comfy.model_management's interrupt, as ComfyUI has it: Cancel sets a flag under a lock
    (interrupt_current_processing); a node that calls throw_exception_if_processing_interrupted gets
    InterruptProcessingException, and the flag is cleared."""

    class InterruptProcessingException(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("comfy.model_management")
        self._lock = threading.RLock()
        self._flag = False

    def interrupt_current_processing(self, value: bool = True) -> None:
        with self._lock:
            self._flag = value

    def throw_exception_if_processing_interrupted(self) -> None:
        with self._lock:
            if self._flag:
                self._flag = False
                raise self.InterruptProcessingException()


EXAMPLES_DIR = PACKAGE_DIR / "example_workflows"


def api_prompt(workflow: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A workflow as ComfyUI's frontend saves it (its template format) to the prompt it queues (the API
    format): per node id, the class and the inputs, widget values by widget name and links as [node id, slot]."""
    links = {link[0]: link for link in workflow["links"]}
    prompt = {}
    for node in workflow["nodes"]:
        if node.get("mode", 0) != 0:  # muted or bypassed nodes are not queued
            continue
        widgets = [i["name"] for i in node["inputs"] if "widget" in i]
        inputs: dict[str, Any] = dict(zip(widgets, node["widgets_values"]))
        for entry in node["inputs"]:
            if entry.get("link") is not None:
                _, origin, slot, *_ = links[entry["link"]]
                inputs[entry["name"]] = [str(origin), slot]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


class WorkflowRunner:
    """ComfyUI's execution of queued prompts, for one node package: each output node's inputs first (depth
    first, as ComfyUI's execution list takes them), a node's FUNCTION called by keyword with its hidden
    UNIQUE_ID and PROMPT (the queued prompt), and its outputs kept between queue runs, of any prompt (as
    ComfyUI's LRU cache keeps them): a node runs again only when one of its input values, an upstream node's
    run, or its IS_CHANGED differs. Nodes of other packages (a video loader, Save Video) are `stand_ins`:
    class name -> a function of the node's inputs that returns its outputs."""

    def __init__(self, package: types.ModuleType, stand_ins: dict[str, Any]) -> None:
        self.package = package
        self.stand_ins = stand_ins
        self._cache: dict[str, tuple[Any, tuple]] = {}  # node id -> (signature, outputs)
        self.ran: list[str] = []  # the node ids the last queue run executed, in order

    def queue(self, prompt: dict[str, dict[str, Any]]) -> dict[str, tuple]:
        """Run the prompt; the outputs of every node (run or cached) by id."""
        outputs: dict[str, tuple] = {}
        signatures: dict[str, Any] = {}
        self.ran = []
        used = {v[0] for node in prompt.values() for v in node["inputs"].values() if isinstance(v, list)}
        for node_id in [n for n in prompt if n not in used]:
            self._visit(prompt, node_id, outputs, signatures)
        return outputs

    def _visit(self, prompt: dict, node_id: str, outputs: dict, signatures: dict) -> None:
        if node_id in outputs:
            return
        node = prompt[node_id]
        for value in node["inputs"].values():
            if isinstance(value, list):
                self._visit(prompt, value[0], outputs, signatures)
        kwargs = {k: outputs[v[0]][v[1]] if isinstance(v, list) else v for k, v in node["inputs"].items()}
        cls = self.package.NODE_CLASS_MAPPINGS.get(node["class_type"])
        hidden = cls.INPUT_TYPES().get("hidden", {}) if cls is not None else {}
        kwargs.update({name: node_id for name, kind in hidden.items() if kind == "UNIQUE_ID"})
        # as ComfyUI: IS_CHANGED gets the node's constants, its linked inputs as None (and PROMPT as {})
        constants = {k: None if isinstance(node["inputs"].get(k), list) else v for k, v in kwargs.items()}
        for name in (name for name, kind in hidden.items() if kind == "PROMPT"):
            kwargs[name], constants[name] = prompt, {}
        changed = cls.IS_CHANGED(**constants) if cls is not None and hasattr(cls, "IS_CHANGED") else None
        signature = (node["class_type"], changed, tuple(sorted(
            (k, signatures[v[0]], v[1]) if isinstance(v, list) else (k, repr(v)) for k, v in node["inputs"].items())))
        signatures[node_id] = signature
        cached = self._cache.get(node_id)
        if cached is not None and cached[0] == signature and changed == changed:  # NaN: always runs
            outputs[node_id] = cached[1]
            return
        if cls is None:
            result = self.stand_ins[node["class_type"]](**kwargs)
        else:
            result = run_node(self.package, node["class_type"], **kwargs)
        self.ran.append(node_id)
        outputs[node_id] = result
        self._cache[node_id] = (signature, result)
