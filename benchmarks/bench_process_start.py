"""What a fresh engine process pays before its first start-up phase: interpreter, imports, CUDA's first use.

An engine's start-up line names its phases (load, warm-up, ...) and how long the process had run before
the first of them. This splits that "before" into the steps every engine process takes, in the order it
takes them, each timed in a fresh child process: the interpreter, `import torch`, Loom's session module,
the CUDA context, the first cuBLAS and cuDNN calls (their libraries load on first use), triton, torch's
compiler, and a first small compiled function (its cache warm after the first run). The first run is
reported apart from the others: a fresh machine reads every library from disk once.

Each child first sets up Python's bytecode cache as the engine's entry point does
(`enable_bytecode_cache`: where torch was installed without compiled bytecode, it is kept under Loom's
cache folder, so the first run compiles torch's modules and the later ones read them);
`--no-bytecode-cache` leaves Python's settings as installed, to compare.

`--overlap` adds runs that import torch's compiler in a thread started right after `import torch`, beside
the steps up to cuDNN in the main thread: whether the compiler's import can hide behind CUDA's
start-up (their GIL-free parts) or only queues behind it. It reports that span against the same steps
one after another.

    python benchmarks/bench_process_start.py --runs 4 --json out/process_start.json
    python benchmarks/bench_process_start.py --upto compiler      # stop before the compiled function
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loom_live.engine.graphs.compile_cache import CACHE_ENV_OFF  # noqa: E402

# (key, what the table calls it); the child times them in this order
STEPS = [("interpreter", "interpreter and site (to the child's first line)"),
         ("torch", "import torch"),
         ("loom", "import Loom's session module"),
         ("cuda", "CUDA context (first tensor on the GPU)"),
         ("cublas", "first bf16 matmul (cuBLAS loads)"),
         ("cudnn", "first conv3d (cuDNN loads)"),
         ("triton", "import triton"),
         ("compiler", "import torch's compiler (Dynamo, Inductor)"),
         ("compile", "first compiled function, called once")]

CHILD = textwrap.dedent("""
    import time
    t_first = time.time()
    import json, sys
    from loom_live.engine.graphs.compile_cache import enable_bytecode_cache
    upto = sys.argv[1]
    times = {"interpreter": t_first - float(sys.argv[2])}
    folder = enable_bytecode_cache()  # as the engine's entry point does
    times["bytecode"] = f"kept in {folder}" if folder else "as installed (or LOOM_BYTECODE_CACHE=0)"

    def timed(key, fn):
        t0 = time.perf_counter()
        try:
            fn()
        except ImportError as exc:
            times[key] = f"not installed: {exc.name}"
            return
        times[key] = time.perf_counter() - t0

    def steps():
        yield "torch", lambda: __import__("torch")
        import torch
        yield "loom", lambda: __import__("loom_live.engine.stream.session")
        cuda = torch.cuda.is_available()

        def on_gpu(fn):
            def run():
                fn()
                torch.cuda.synchronize()
            return run if cuda else None

        yield "cuda", on_gpu(lambda: torch.empty(1, device="cuda"))
        yield "cublas", on_gpu(lambda: torch.ones(1024, 1024, device="cuda", dtype=torch.bfloat16).matmul(
            torch.ones(1024, 1024, device="cuda", dtype=torch.bfloat16)))
        yield "cudnn", on_gpu(lambda: torch.nn.functional.conv3d(
            torch.ones(1, 16, 4, 32, 32, device="cuda", dtype=torch.bfloat16),
            torch.ones(16, 16, 3, 3, 3, device="cuda", dtype=torch.bfloat16), padding=1))
        yield "triton", lambda: __import__("triton")

        def compiler():
            import torch._dynamo
            import torch._inductor.compile_fx  # noqa: F401

        yield "compiler", compiler
        device = "cuda" if cuda else "cpu"
        yield "compile", lambda: torch.compile(lambda x: torch.tanh(x) * 2 + 1, dynamic=False)(
            torch.ones(64, device=device))

    if upto == "overlap":  # the compiler's import in a thread beside the main thread's steps up to cuDNN
        import threading
        import torch
        t0 = time.perf_counter()
        thread = threading.Thread(target=lambda: __import__("torch._inductor.compile_fx"))
        thread.start()
        for key, fn in steps():
            if key == "torch":
                continue
            if key == "triton":
                break
            if fn is not None:
                fn()
        thread.join()
        times["overlap"] = time.perf_counter() - t0
    else:
        for key, fn in steps():
            if fn is None:
                times[key] = "no CUDA device"
            else:
                timed(key, fn)
            if key == upto:
                break
    print(json.dumps(times))
""")


def run_child(upto: str, env: dict[str, str]) -> dict[str, float | str]:
    t_spawn = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, upto, repr(t_spawn)], capture_output=True, text=True,
                         timeout=600, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"bench_process_start: the child process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict[str, float | str]]) -> list[dict]:
    rows = []
    for key, label in STEPS:
        values = [run.get(key) for run in runs]
        if values[0] is None:
            break
        numbers = [v for v in values if isinstance(v, float)]
        later = numbers[1:] or numbers
        rows.append({"step": key, "label": label, "first_s": numbers[0] if numbers else None,
                     "median_later_s": statistics.median(later) if later else None,
                     "note": next((v for v in values if isinstance(v, str)), None)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=4, help="child processes, one after another (at least 1)")
    parser.add_argument("--upto", choices=[key for key, _ in STEPS], default=STEPS[-1][0],
                        help="the last step timed")
    parser.add_argument("--no-bytecode-cache", action="store_true",
                        help="children leave Python's bytecode settings as installed (LOOM_BYTECODE_CACHE=0)")
    parser.add_argument("--overlap", action="store_true",
                        help="also time the compiler's import in a thread beside the steps up to cuDNN")
    parser.add_argument("--json", type=Path, help="write the runs and the summary here")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    keys = [key for key, _ in STEPS]
    if args.overlap and keys.index(args.upto) < keys.index("compiler"):
        parser.error(f"--overlap compares with the steps up to the compiler's import; --upto {args.upto} "
                     "stops before it")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.no_bytecode_cache:
        env[CACHE_ENV_OFF] = "0"
    runs = [run_child(args.upto, env) for _ in range(args.runs)]
    rows = summarise(runs)
    print(f"bytecode: {runs[-1]['bytecode']}")
    print(f"{'step':<48}{'first s':>10}{'later s':>10}")
    for row in rows:
        cells = [f"{row[k]:10.3f}" if row[k] is not None else f"{'-':>10}" for k in ("first_s", "median_later_s")]
        print(f"{row['label']:<48}{''.join(cells)}  {row['note'] or ''}".rstrip())
    timed = [row["median_later_s"] for row in rows if row["median_later_s"] is not None]
    print(f"{'in all':<48}{'':>10}{sum(timed):10.3f}")
    overlap = None
    if args.overlap:
        parts = ("loom", "cuda", "cublas", "cudnn", "compiler")  # the same steps, each its median over the runs
        medians = [statistics.median(v) for k in parts if (v := [r[k] for r in runs if isinstance(r.get(k), float)])]
        sequential = sum(medians)
        spans = [run_child("overlap", env)["overlap"] for _ in range(args.runs)]
        overlap = {"sequential_s": sequential, "threaded_s": statistics.median(spans), "spans_s": spans}
        print(f"{'loom to cuDNN, then the compiler (sequential)':<48}{'':>10}{overlap['sequential_s']:10.3f}")
        print(f"{'the same, the compiler in a thread beside':<48}{'':>10}{overlap['threaded_s']:10.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": {"python": sys.version.split()[0], "runs": args.runs},
                                         "runs": runs, "results": rows, "overlap": overlap}, indent=2))


if __name__ == "__main__":
    main()
