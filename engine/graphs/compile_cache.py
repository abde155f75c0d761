"""Compiled artefacts that outlive the engine process, so a restarted engine starts in seconds.

A GPU engine compiles its fused steps with Inductor (Triton kernels) on first use. Without a cache
that survives the process, every restart after a crash pays the whole compilation again, and a show
waits in fallback. Inductor's FX graph cache and AOTAutograd's cache key the compiled code by the
graph, the shapes and the software versions, so reusing them across processes is safe; they only
need a folder that persists: Inductor's default lives in the temporary directory, which a reboot or
a fresh container empties. This puts Inductor's and Triton's caches under one Loom folder (one
place to inspect or clear) unless the user chose their own through the usual variables.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "LOOM_CACHE_DIR"


def cache_root() -> Path:
    """$LOOM_CACHE_DIR, else $XDG_CACHE_HOME/loom, else ~/.cache/loom."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "loom"


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
