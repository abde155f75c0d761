"""A cold engine start, repeatable on a machine that has already compiled: each variant starts `loom bench`
in a fresh process whose compile caches (Inductor's graphs, Triton's kernels, the saved steps, the CUDA
driver's JIT cache) are an empty folder, while Python's bytecode stays as this machine keeps it.

Why: a fresh GPU machine is cold only for its first command, so a start-up change could be weighed against
the default once a session at most. Here every variant compiles everything from nothing, one after the
other in the same call, and the table says where each start went: the warm-up's compile, the part of it
spent awaiting Triton's kernel compiles, Triton's autotuning at each new kernel's first launch, the step
whose first calls took longest, and the stream's FPS with the kernels that variant chose.

A variant sets compiler options in the child before the engine starts (`--option VARIANT:KEY=VALUE` adds
one: an Inductor option, or `dynamo.NAME` for Dynamo's) or config keys of `loom bench`; the named ones have
Triton time several block sizes per kernel (`autotune`: `model.autotune_kernels`) or make every size dynamic
from a function's first compile (`dynamic-first`). A GPU engine sets Inductor's autotuning switches itself
from `model.autotune_kernels` when it loads, over any `--option` for them:

    python benchmarks/bench_cold_start.py --json out/cold_start.json
    python benchmarks/bench_cold_start.py --variants default,autotune -- -c wan2.1-1.3b --frames 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom_live.engine.graphs.compile_cache import CACHE_ENV, enable_bytecode_cache  # noqa: E402

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "autotune": {},  # Triton times block sizes per elementwise and reduction kernel (the engine sets it)
    # every size dynamic from a function's first compile (the DiT's functions; the VAE's compile static
    # regardless): one graph where the first chunk's static one and a dynamic one follow each other now
    "dynamic-first": {"dynamo.assume_static_by_default": False},
}
SETTINGS: dict[str, list[str]] = {  # loom bench options by variant
    "autotune": ["--set", "model.autotune_kernels=true"],
}
BENCH_ARGS = ["-c", "wan2.1-1.3b", "--steps", "700", "--frames", "600"]

# The child: the variant's options first (they key the compile caches, so they must be set before any
# compile), then `loom bench` as the command line would run it.
CHILD = f"""
import json, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from bench_cold_start import apply_options
print("options:", json.dumps(apply_options(json.loads(sys.argv[1]))), file=sys.stderr, flush=True)
from loom_live.plugin.cli.main import main
sys.exit(main(["bench", *sys.argv[2:]]))
"""


def _config(key: str) -> tuple[Any, str]:
    """The config module an option key names and the name in it: `dynamo.NAME` is torch._dynamo.config's
    NAME, any other dotted name torch._inductor.config's (such as triton.autotune_pointwise)."""
    if key.startswith("dynamo."):
        import torch._dynamo.config as dynamo

        return dynamo, key.removeprefix("dynamo.")
    import torch._inductor.config as inductor

    return inductor, key


def apply_options(options: dict[str, Any]) -> dict[str, Any]:
    """Set each option; returns what the config holds afterwards, read back."""
    for key, value in options.items():
        setattr(*_config(key), value)
    return {key: getattr(*_config(key)) for key in options}


def check_options(options: dict[str, Any]) -> None:
    """Refuse an option torch's compiler does not have before any variant runs (each costs minutes)."""
    import torch

    for key in options:
        module, name = _config(key)
        if name not in module.get_config_copy():
            raise SystemExit(f"bench_cold_start: torch {torch.__version__} has no compiler option {key!r} (a "
                             "dotted name under torch._inductor.config such as triton.autotune_pointwise, or "
                             "dynamo.NAME for torch._dynamo.config's)")


def run_variant(name: str, options: dict[str, Any], bench_args: list[str], timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"loom_cold_{name}_") as cache:
        out = Path(cache) / "bench.json"
        env = {**os.environ, CACHE_ENV: cache}
        for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # under the fresh folder, not the user's
            env.pop(var, None)
        env["CUDA_CACHE_PATH"] = str(Path(cache) / "nv")  # the driver's JIT cache too, empty as on a fresh machine
        cmd = [sys.executable, "-c", CHILD, json.dumps(options), "--bridge", "none", "--no-baseline",
               "--json", str(out), *bench_args]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            code, said, tail = proc.returncode, proc.stderr, (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            code, said, tail = None, "", f"stopped after {timeout:.0f} s"
        row: dict[str, Any] = {"variant": name, "options": options, "exit": code, "wall_s": time.perf_counter() - t0}
        applied = [line for line in said.splitlines() if line.startswith("options: ")]
        warned = [line for line in said.splitlines() if "WARNING" in line or "Error" in line]
        if warned:  # what went wrong inside a start that still ran (a helper that failed, a fallback)
            row["warnings"] = warned[:20]
        if applied:  # what the child's compiler config holds, read back after setting
            row["applied"] = json.loads(applied[0].removeprefix("options: "))
        if code != 0 or not out.is_file():
            return {**row, "error": tail}
        loom = json.loads(out.read_text())["loom"]
    return {**row, "fps": loom["fps"], "startup": loom["startup"]}


def summary(row: dict[str, Any]) -> list[str]:
    if "error" in row:
        return [row["variant"], f"failed (exit {row['exit']}): {row['error'].strip().splitlines()[-1][:80]}"]
    start = row["startup"]
    warm = start["inside"].get("warmup", {})
    work = list(start["inside"].values())
    autotune = sum(p.get("autotune_s", 0.0) for p in work)
    waited = sum(p.get("kernel_wait_s", 0.0) for p in work)
    first = sorted(start.get("first_calls_s", {}).items(), key=lambda kv: -kv[1])[:2]
    before = "-" if start.get("before_s") is None else f"{start['before_s']:.1f}"
    return [row["variant"], before, f"{start['total_s']:.1f}", f"{start['phases_s'].get('warmup', 0.0):.1f}",
            f"{warm.get('compile_s', 0.0):.1f}", f"{waited:.1f}", f"{autotune:.1f}", f"{row['fps']:.2f}",
            ", ".join(f"{n} {s:.1f}" for n, s in first) or "-"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="default,autotune",
                        help=f"comma-separated, in order (named: {', '.join(VARIANTS)}; others via --option)")
    parser.add_argument("--option", action="append", default=[], metavar="VARIANT:KEY=VALUE",
                        help="a compiler option for a variant (Inductor's, or dynamo.NAME; JSON value: true, 8, "
                             "\"x\"); repeatable")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one variant may take")
    parser.add_argument("--json", type=Path, help="write every variant's figures here")
    parser.add_argument("bench_args", nargs="*", help=f"after --: loom bench's arguments (default: {BENCH_ARGS})")
    args = parser.parse_args()
    variants = {name: dict(VARIANTS.get(name, {})) for name in args.variants.split(",") if name}
    for spec in args.option:
        name, sep, assignment = spec.partition(":")
        key, eq, value = assignment.partition("=")
        if not (sep and eq and name in variants):
            parser.error(f"--option {spec!r}: expected VARIANT:KEY=VALUE with VARIANT one of {list(variants)}")
        try:
            variants[name][key] = json.loads(value)
        except json.JSONDecodeError:
            parser.error(f"--option {spec!r}: the value must be JSON (true, false, a number, a quoted string)")
    for name, options in variants.items():
        if not options and name not in VARIANTS:  # a name of the user's own needs its --option
            parser.error(f"variant {name!r} names no options: expected one of {list(VARIANTS)} or --option {name}:...")
        check_options(options)
    enable_bytecode_cache()  # the children keep reading this machine's bytecode while their compile caches start empty
    rows = []
    for name, options in variants.items():
        print(f"bench_cold_start: {name} {options or ''}", file=sys.stderr, flush=True)
        rows.append(run_variant(name, options, [*(args.bench_args or BENCH_ARGS), *SETTINGS.get(name, [])],
                                args.timeout))
    head = ["variant", "process before s", "start-up s", "warm-up s", "compile s", "awaiting Triton s",
            "autotune s", "FPS", "longest first calls s"]
    table = [head, *map(summary, rows)]
    widths = [max(len(r[i]) for r in table if i < len(r)) for i in range(len(head))]
    for r in table:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)))
    for row in rows:
        if row.get("warnings"):
            print(f"{row['variant']}: {len(row['warnings'])} warning lines, the first: {row['warnings'][0][:300]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "variants": rows}, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
