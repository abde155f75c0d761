"""`loom prepare`: start the engine once before a show, so that later starts load what it compiled.

An engine start compiles the DiT's and the VAE's steps; Inductor's caches keep the kernels, and by default
a start also loads the steps kept whole in the compile cache folder instead of tracing them again
(`model.saved_block_ops`, `vae.saved_steps`). Building those whole costs more than compiling them as usual,
so an ordinary start never builds them: this command does (both set to `build`), once per config, after
installing or updating Loom or torch, or on another GPU (the folder is named after all of them).
"""

from __future__ import annotations

import argparse
import sys
import time

from loom_live.engine.config import load_config
from loom_live.plugin.cli.common import add_config_options
from loom_live.plugin.cli.preflight import check_weights

BUILD = ("model.saved_block_ops=build", "vae.saved_steps=build")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="start the engine once before a show, so later starts load its compiled "
                                       "steps",
                       description="Start the engine for a config once, compile and warm it up as a show's start "
                                   "would, and keep its compiled steps whole in the compile cache folder, so the "
                                   "next start of that config loads them instead of compiling (a GPU; a CPU "
                                   "compiles nothing). Run it after installing or updating Loom or torch.")
    add_config_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, [*args.overrides, *BUILD])
    from loom_live.engine.models.loading import resolve_device

    device = resolve_device(cfg.model.device)
    check_weights(cfg)  # on a CPU too: "nothing to prepare" said of a config whose start would fail misled
    if device.type != "cuda":
        print(f"loom prepare: nothing to prepare on {device.type}: an engine there compiles nothing ahead, so "
              "each start is as quick as it gets", file=sys.stderr)
        return 0
    from loom_live.engine.graphs.compile_cache import cache_root
    from loom_live.engine.graphs.saved_compiles import SAVED, compiled_folder, torch_saves_compiles
    from loom_live.engine.session_api import open_session
    from loom_live.engine.startup_progress import STARTUP_PROGRESS

    print(f"loom prepare: starting {cfg.model.preset} at {cfg.resolution.width}x{cfg.resolution.height} once "
          "(compile and warm-up: a cold start takes minutes)", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with STARTUP_PROGRESS.to(lambda text: print(f"loom prepare: {text}", file=sys.stderr, flush=True)):
        session = open_session(cfg)
    seconds = time.perf_counter() - t0
    session.close()
    folder = compiled_folder(cache_root(), device)
    ranks = f" (rank 0's; the other {cfg.parallel.gpus - 1} ranks keep theirs too)" if cfg.parallel.gpus > 1 else ""
    print(f"loom prepare: ready in {seconds:.1f} s; compiled steps{ranks}: {SAVED.built} built and kept, "
          f"{SAVED.loaded} already kept, in {folder}", file=sys.stderr)
    if SAVED.fallbacks or not torch_saves_compiles():
        print(f"loom prepare: {SAVED.fallbacks or 'all'} compiled steps could not be kept whole (torch refused "
              "them: see the warnings above); a start compiles those as usual", file=sys.stderr)
    elif SAVED.built + SAVED.loaded:
        print("loom prepare: the next start of this config loads them", file=sys.stderr)
    else:
        print(f"loom prepare: {cfg.model.family} keeps no steps whole; its compile caches are warm now",
              file=sys.stderr)
    return 0
