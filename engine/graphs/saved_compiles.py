"""Compiled steps saved whole, Dynamo's output included, so a warm start loads them instead of tracing.

Why: with Inductor's caches warm, a restarted engine still runs Dynamo over each compiled step's
bytecode (its trace, its guards, the caches' lookups), most of a warm start's compile time. torch can
save a compiled function whole (`aot_compile`, `torch.compiler.load_compiled_function`), and loading
one skips the trace. A `SavedCompile` compiles its function once per argument signature on first use
and saves the result; a later process loads that file instead. The files sit in a folder named after
everything compiled code depends on (torch, triton, Python, the device, Loom's engine sources), so a
changed engine or another GPU never loads code built for the old one.

Building a step costs more than compiling it as usual (torch's whole-function compile does not read
Inductor's graph cache), so a start only loads by default: a step with no file compiles as usual, and
`build` (what `loom prepare` asks for) builds and saves the missing ones.

The torch API is experimental: a file that fails to load or to save, a function it cannot compile
whole, or a call the loaded guards refuse falls back to `torch.compile` for that function, with a
warning: a slower start, never a wrong frame.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)


@dataclass
class SavedCounts:
    """Process-wide: what the start-up breakdown reports beside torch's own compile counters."""

    loaded: int = 0
    built: int = 0
    unsaved: int = 0  # steps with no file, compiled as usual (the folder is only loaded from)
    fallbacks: int = 0
    load_s: float = 0.0
    first_calls: dict[str, list[float]] = field(default_factory=dict)  # per step, each signature's first call

    def note_first_call(self, name: str, seconds: float) -> None:
        """A signature's first call: its load, build or compile, Triton's autotuning and one run, which on
        a cold start says which step the wait is for."""
        self.first_calls.setdefault(name, []).append(seconds)


SAVED = SavedCounts()
KEEP_FOLDERS = 4  # compiled/<key> folders kept: each engine update, torch update or other GPU adds one
KEY_LENGTH = 16  # hex digits of a folder's key


def compiled_folder(root: Path, device: torch.device) -> Path:
    """`root`/compiled/<key>: one folder per torch, triton, Python, device and engine source version."""
    parts = [torch.__version__, _triton_version(), platform.python_version(), _device_kind(device), _engine_digest()]
    return root / "compiled" / hashlib.sha256("\n".join(parts).encode()).hexdigest()[:KEY_LENGTH]


def _is_key_folder(folder: Path) -> bool:
    """Whether `folder` is one `compiled_folder` names: a key in a folder named `compiled`."""
    return folder.parent.name == "compiled" and re.fullmatch(f"[0-9a-f]{{{KEY_LENGTH}}}", folder.name) is not None


def signature(value: Any) -> Hashable:
    """What a compiled step's code depends on in one argument: tensors' shapes, strides, dtypes and
    devices, plain values as they are, containers and plain objects (a VAE's history cache) by their
    contents. Raises TypeError for anything else, so a step is never keyed on an object's identity."""
    if isinstance(value, torch.Tensor):  # torch's own values, not their strings: every call of a step is keyed
        return ("tensor", value.shape, value.stride(), value.dtype, value.device, value.requires_grad)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.device, torch.dtype, torch.memory_format)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *map(signature, value))
    if isinstance(value, dict):
        return ("dict", *((k, signature(v)) for k, v in value.items()))
    if hasattr(value, "__dict__") and not isinstance(value, nn.Module) and not callable(value):
        return (type(value).__qualname__, signature(vars(value)))
    raise TypeError(f"saved compiles: cannot key a step on a {type(value).__qualname__}; "
                    "allowed: tensors, plain values, tuples, lists, dicts and plain objects of those")


def module_signature(module: nn.Module) -> str:
    """The module tree's layout: each submodule's type and plain settings, each weight's signature.
    Computed once, when the step is made (after the model's layout choices, before the first call)."""
    rows: list[Any] = []
    for name, sub in module.named_modules():
        settings = sorted((k, _setting(v)) for k, v in vars(sub).items() if not k.startswith("_") and k != "training")
        rows.append((name, type(sub).__qualname__, settings))
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        rows.append((name, signature(tensor)))
    return repr(rows)


class SavedCompile:
    """`fn` compiled whole (static shapes) once per signature of its arguments and kept on disk.

    With an `owner` module, `fn` is that module's unbound method and the module is passed as its first
    argument: its weights are the compiled code's inputs, not constants, so a saved step serves any
    weights of the same layout. After the first signature, a new one under torch's
    `eager_on_recompile` stance (a session after its warm-up) is loaded if it was saved, and otherwise
    runs `fn` eagerly, as a recompile would.

    Without `build`, a signature with no file runs `plain`, the function as the caller compiles it
    without saving (default: `fn` through torch.compile with static shapes), so a start that only
    loads costs no more than one that does not use the folder; a failure falls back to `plain` too."""

    def __init__(self, fn: Callable[..., Any], folder: Path, name: str, *, build: bool = True,
                 plain: Callable[..., Any] | None = None, owner: nn.Module | None = None,
                 options: dict[str, Any] | None = None) -> None:
        self.fn, self.folder, self.name, self.build, self.owner, self.options = fn, folder, name, build, owner, options
        self._owner_key = module_signature(owner) if owner is not None else ""
        self._steps: dict[Hashable, Callable[..., Any]] = {}
        self._plain = plain
        self._fell_back = False

    def __call__(self, *args: Any) -> Any:
        full = args if self.owner is None else (self.owner, *args)
        try:
            key = signature(args)
        except TypeError as exc:
            if not self._fell_back:
                logger.warning("saved compile %s: %s; torch.compile as usual", self.name, exc)
            return self._fall_back()(*full)
        step = self._steps.get(key)
        if step is not None:
            return self._run(step, key, full)
        t0 = time.perf_counter()
        if self._steps and _eager_on_recompile() and not self.path(key).is_file():
            step = self.fn  # a build now would stall a stream (a load takes milliseconds): eager from now on
        else:
            step = self._resolve(key, full)
        self._steps[key] = step
        out = self._run(step, key, full)
        SAVED.note_first_call(self.name, time.perf_counter() - t0)
        return out

    def _run(self, step: Callable[..., Any], key: Hashable, full: tuple[Any, ...]) -> Any:
        try:
            return step(*full)
        except RuntimeError as exc:  # the loaded guards refuse before anything runs
            if "GuardManager check failed" not in str(exc):
                raise
            logger.warning("saved compile %s: its guards refused a call (%s); compiling it again",
                           self.name, str(exc).splitlines()[0][:300])
            step = self._steps[key] = self._fall_back()
            return step(*full)

    def path(self, key: Hashable) -> Path:
        digest = hashlib.sha256(repr((self._owner_key, key, self.options)).encode()).hexdigest()[:24]
        return self.folder / f"{self.name}-{digest}.bin"

    def _resolve(self, key: Hashable, full: tuple[Any, ...]) -> Callable[..., Any]:
        if not torch_saves_compiles():
            return self._fall_back()
        path = self.path(key)
        if path.is_file():
            t0 = time.perf_counter()
            try:
                with path.open("rb") as f:
                    step = torch.compiler.load_compiled_function(f, f_globals=self.fn.__globals__)
                SAVED.loaded += 1
                SAVED.load_s += time.perf_counter() - t0
                os.utime(self.folder)  # in use: the last folder `make_folder` would remove
                return step
            except Exception as exc:  # noqa: BLE001 (another torch's file, a torn one: build it again)
                logger.warning("saved compile %s: %s did not load (%s); compiling it again", self.name, path.name, exc)
        if not self.build:
            SAVED.unsaved += 1
            return self._compiled()
        try:
            with _aot_compile_on():
                compiled = torch.compile(self.fn, fullgraph=True, dynamic=False, options=self.options)
            step = compiled.aot_compile((full, {}))
        except Exception as exc:  # noqa: BLE001 (the experimental API refused this function)
            logger.warning("saved compile %s: cannot compile it whole (%s); torch.compile as usual", self.name, exc)
            return self._fall_back()
        SAVED.built += 1
        try:
            make_folder(self.folder)
            _save_whole(step, path)
        except Exception as exc:  # noqa: BLE001 (a read-only folder, an unsaveable step: the next start compiles)
            logger.warning("saved compile %s: not saved (%s); the next start compiles it again", self.name, exc)
        return step

    def _fall_back(self) -> Callable[..., Any]:
        if not self._fell_back:
            self._fell_back = True
            SAVED.fallbacks += 1
        return self._compiled()

    def _compiled(self) -> Callable[..., Any]:
        if self._plain is None:
            self._plain = torch.compile(self.fn, dynamic=False, options=self.options)
        return self._plain


@functools.cache
def torch_saves_compiles() -> bool:
    """Whether this torch can save and load a compiled function whole; says once when it cannot."""
    if hasattr(torch.compiler, "load_compiled_function"):
        return True
    logger.warning("saved compiles: torch %s cannot save compiled functions (no torch.compiler."
                   "load_compiled_function); compiling with torch.compile as usual", torch.__version__)
    return False


def _aot_compile_on() -> contextlib.AbstractContextManager[Any]:
    """Where torch gates `aot_compile` behind a Dynamo setting (off by default in 2.11, on in 2.13), turn it on
    while the compiled wrapper is made: the method is attached then or never."""
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        return torch._dynamo.config.patch(enable_aot_compile=True)
    return contextlib.nullcontext()


def _save_whole(step: Any, path: Path) -> None:
    """Write `step` beside `path`, then rename it there: a second engine starting beside this one (a hot
    standby) never loads a half-written file, whatever torch's own writer does (some versions write in place)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        step.save_compiled_function(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def make_folder(folder: Path) -> None:
    """Create `folder` and, when it is new, remove its oldest siblings beyond `KEEP_FOLDERS` (steps built
    for engines, torches or GPUs no longer in use); a step loading from a removed folder is built again.
    Only folders `compiled_folder` names are removed, beside one it names: a step saved to a folder of the
    caller's choosing leaves whatever else sits beside that folder alone."""
    if folder.is_dir():
        return
    folder.mkdir(parents=True, exist_ok=True)
    if not _is_key_folder(folder):
        return
    siblings = sorted((p for p in folder.parent.iterdir() if p.is_dir() and p != folder and _is_key_folder(p)),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for old in siblings[KEEP_FOLDERS - 1:]:
        logger.info("saved compiles: removing %s (built for another engine, torch or GPU)", old)
        shutil.rmtree(old, ignore_errors=True)


def _eager_on_recompile() -> bool:
    eval_frame = getattr(torch._dynamo, "eval_frame", None)
    stance = getattr(getattr(eval_frame, "_stance", None), "stance", "default")
    return stance == "eager_on_recompile"


def _setting(value: Any) -> Any:
    try:
        return signature(value)
    except TypeError:
        return getattr(value, "__qualname__", None) or type(value).__qualname__


def _device_kind(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor} cuda {torch.version.cuda}"
    return f"{device.type} {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "no triton"
    return triton.__version__


@functools.cache
def _engine_digest() -> str:
    engine = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(engine.rglob("*.py")):
        digest.update(str(path.relative_to(engine)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
