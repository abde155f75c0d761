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


def run_node(package: types.ModuleType, node: str, **kwargs: Any) -> Any:
    """What ComfyUI does for one node of a workflow: instantiate the class, call its FUNCTION by keyword."""
    cls = package.NODE_CLASS_MAPPINGS[node]
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
