"""Compiled artefacts that outlive the engine process, so a restarted engine starts in seconds.

A GPU engine compiles its fused steps with Inductor (Triton kernels) on first use. Without a cache
that survives the process, every restart after a crash pays the whole compilation again, and a show
waits in fallback. Inductor's FX graph cache and AOTAutograd's cache key the compiled code by the
graph, the shapes and the software versions, so reusing them across processes is safe; they only
need a folder that persists: Inductor's default lives in the temporary directory, which a reboot or
a fresh container empties. This puts Inductor's and Triton's caches under one Loom folder (one
place to inspect or clear) unless the user chose their own through the usual variables.

Python's own compiled bytecode is the same kind of artefact: an installation that carries none for
torch (a container image built with PYTHONDONTWRITEBYTECODE, a read-only site-packages) compiles
torch's and its compiler's thousands of modules from source in every process, which makes their
imports several times slower on each engine start. `enable_bytecode_cache` keeps that bytecode under
the same Loom folder, never beside the installed sources.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "LOOM_CACHE_DIR"


def cache_root() -> Path:
    """$LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom, else ~/.cache/loom."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "loom"


CACHE_ENV_OFF = "LOOM_BYTECODE_CACHE"  # "0": leave Python's bytecode settings as they are


def enable_bytecode_cache(root: Path | None = None) -> Path | None:
    """Where the installed torch carries no compiled bytecode, have this process (and the processes it
    starts) keep Python's bytecode under `root`/pycache (default `cache_root()`) and read it back next
    time. Returns that folder, or None where nothing changed: torch's bytecode is installed, the user
    chose a bytecode folder (PYTHONPYCACHEPREFIX), torch is not installed, or LOOM_BYTECODE_CACHE=0.

    Call first in a process entry point: modules imported before it are not cached. Python checks each
    cached file against its source's size and time, so an upgraded torch is compiled again, once. On the
    first start with an empty folder, the packages an engine imports are compiled on the other cores
    meanwhile (`compile_ahead`), where there are enough of them."""
    if os.environ.get(CACHE_ENV_OFF) == "0" or sys.pycache_prefix is not None:
        return None
    spec = importlib.util.find_spec("torch")  # finds it without importing it
    if spec is None or not spec.origin or _bytecode_current(spec.origin):
        return None
    folder = (root or cache_root()) / "pycache"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.warning("bytecode cache folder %s unusable (%s); torch's imports stay slow", folder, exc)
        return None
    sys.pycache_prefix, sys.dont_write_bytecode = str(folder), False
    os.environ["PYTHONPYCACHEPREFIX"] = str(folder)  # the engine's own workers (Inductor's compile pool)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    workers, probe = (os.cpu_count() or 1) - 1, Path(spec.origin).parent / "_inductor" / "compile_fx.py"
    if workers >= AHEAD_MIN_WORKERS and probe.is_file() and not _cached(probe):  # the first start with this folder
        compile_ahead(_package_dirs(AHEAD_PACKAGES), workers)
    return folder


# What an engine imports, torch's compiler and what it pulls in (sympy and networkx are most of its modules)
AHEAD_PACKAGES = ("torch", "sympy", "networkx", "mpmath", "triton", "numpy", "jinja2")
AHEAD_MIN_WORKERS = 3  # with fewer spare cores the background compile competes with the imports it would spare
AHEAD_SKIP = r"[/\\](tests?|testing)[/\\]"  # test suites inside the packages: never imported by an engine


def compile_ahead(folders: list[Path], workers: int) -> threading.Thread:
    """Compile the bytecode of `folders` in a background process on `workers` cores, into the bytecode cache
    this process uses, while it goes on importing: on a first start its imports (torch's compiler seconds
    later among them) then mostly read bytecode instead of compiling each module in turn. Python writes each
    file atomically, so the two processes never read a torn one. Returns the thread that waits for it."""
    cmd = [sys.executable, "-m", "compileall", "-q", "-j", str(workers), "-x", AHEAD_SKIP, *map(str, folders)]
    thread = threading.Thread(target=subprocess.run, args=(cmd,), name="loom-bytecode-ahead", daemon=True,
                              kwargs={"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "check": False})
    thread.start()
    return thread


def _package_dirs(names: tuple[str, ...]) -> list[Path]:
    """The installed folders of the top-level packages `names` that are installed (found without importing them)."""
    folders = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            folders.extend(Path(p) for p in spec.submodule_search_locations)
    return folders


def _cached(source: Path) -> bool:
    """Whether the bytecode cache in use already holds `source`'s bytecode (an earlier start wrote it)."""
    return Path(importlib.util.cache_from_source(str(source))).is_file()


def _bytecode_current(source: str) -> bool:
    """Whether `source` has bytecode beside it that Python would use: its header names this Python and, for
    timestamp-checked files, the source's time and size (files copied without their times are stale)."""
    try:
        with open(importlib.util.cache_from_source(source), "rb") as f:
            head = f.read(16)
        stat = os.stat(source)
    except OSError:
        return False
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return False
    if int.from_bytes(head[4:8], "little"):  # hash-based bytecode: checked against the source's hash instead
        return True
    return (int.from_bytes(head[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(head[12:16], "little") == stat.st_size & 0xFFFFFFFF)


def enable_persistent_compile_cache(root: Path | None = None) -> Path:
    """Point Inductor and Triton at folders under `root` (default `cache_root()`) and switch the FX graph
    and AOTAutograd caches on. Call before the first compilation; returns the Inductor folder.

    The switches go through the environment, which torch's compiler config modules read when the first
    compilation imports them: importing them here would import torch._dynamo, seconds of every engine's
    start-up, also for an engine that never compiles (a CPU engine). Where they are already imported,
    they are set directly."""
    root = root or cache_root()
    inductor = root / "inductor"
    try:
        inductor.mkdir(parents=True, exist_ok=True)
        (root / "triton").mkdir(exist_ok=True)
    except OSError as exc:  # a read-only home: compile as before, only slower to restart
        logger.warning("compile cache folder %s unusable (%s); restarts recompile", root, exc)
        return inductor
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.fx_graph_cache = True
    functorch_config = sys.modules.get("torch._functorch.config")
    if functorch_config is not None and hasattr(functorch_config, "enable_autograd_cache"):
        functorch_config.enable_autograd_cache = True
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def set_kernel_autotuning(autotune: bool) -> None:
    """Whether Triton times several block sizes for each compiled elementwise and reduction kernel at its
    first launch (`autotune`), or every such kernel takes Inductor's heuristic pick among its own.

    Why: on a cold compile cache that timing runs at every new kernel's first launch, seconds of a start,
    for kernels (memory-bound norms and elementwise chains) whose heuristic pick streams as fast
    (docs/performance.md). The choice is part of the compile caches' keys, so every process that compiles
    for one engine (its pipeline ranks) makes the same one before its first
    compile. Imports Inductor's config: call it only where the process will compile for a GPU."""
    import torch._inductor.config as inductor

    inductor.triton.autotune_pointwise = autotune
    tests = getattr(inductor, "test_configs", None)  # Inductor's switch to keep only its own reduction pick
    if tests is not None and hasattr(tests, "force_filter_reduction_configs"):
        tests.force_filter_reduction_configs = not autotune
