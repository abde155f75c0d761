"""`loom info`: what this machine offers Loom (Python, torch, GPUs, CUDA IPC, NVIDIA MPS, media libraries)."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from typing import Any

from loom_live.engine.config import list_presets
from loom_live.host_bridge.mps import daemon_pipe
from loom_live.host_bridge.wire.cpu_awake import CpuAwake, idle_states
from loom_live.plugin.cli.common import version


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="show Loom's version, Python, torch, GPUs, CUDA IPC, NVIDIA MPS and library "
                                    "versions")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--presets", action="store_true", help="list the shipped configuration presets")
    p.set_defaults(func=run)


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:  # a broken optional install must not break `loom info`
        return None
    return str(getattr(mod, "__version__", "installed"))


def _gpus() -> list[dict[str, Any]]:
    """The CUDA devices (`collect` asks only where torch sees some)."""
    import torch

    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "uuid": f"GPU-{p.uuid}",
                    "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}"})
    return out


def _cuda_ipc() -> tuple[bool, str]:
    """CUDA IPC needs cuda-python's runtime bindings and a device that supports it."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return False, "cuda-python not installed"
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count == 0:
        return False, "no CUDA device"
    if sys.platform == "darwin":
        return False, "not supported on macOS"
    return True, f"{count} device(s)"


def _mps() -> str:
    """Whether CUDA processes started from here run under an NVIDIA MPS daemon (host_bridge/mps.py)."""
    pipe = daemon_pipe()
    if pipe is None:
        return "off (each process has a CUDA context of its own; README.md, One GPU, several processes)"
    return f"on: a control daemon at {pipe}; the host and the engines it launches share one GPU context"


def _cpu_awake() -> str:
    """Whether `--hold-cpu-awake` (BridgeConfig.hold_cpu_awake) can hold the CPUs out of deep idle states here, and
    the idle states it would rule out (host_bridge/wire/cpu_awake.py)."""
    with CpuAwake() as trial:
        can = "can be held" if trial.held else f"cannot be held: {trial.why}"
    idle = idle_states()
    states = ", ".join(f"{s['name']} {s['latency_us']} us" for s in idle.get("states", []))
    return f"{can}" + (f"; idle driver {idle['driver'] or '?'}: {states or 'no states listed'}" if idle else "")


def _kept_steps() -> str:
    """How many compiled steps are kept whole for this engine, torch and GPU 0 (`loom prepare` keeps them,
    and an engine start loads them); `collect` asks only where torch sees a GPU."""
    import torch

    from loom_live.engine.graphs.compile_cache import cache_root
    from loom_live.engine.graphs.saved_compiles import compiled_folder

    folder = compiled_folder(cache_root(), torch.device("cuda", 0))
    kept = len(list(folder.glob("*.bin"))) if folder.is_dir() else 0
    return f"{kept} in {folder}" + ("" if kept else " (`loom prepare -c PRESET` keeps a config's)")


def collect() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:  # a torch that fails to load (a CUDA library missing) is what `loom info` is run to see
        torch, torch_text = None, f"not importable ({type(exc).__name__}: {exc})"
    cuda = torch is not None and torch.cuda.is_available()
    ipc_ok, ipc_why = _cuda_ipc()
    return {
        "loom": version(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__ if torch is not None else torch_text,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda if torch is not None else None,
        "gpus": _gpus() if cuda else [],
        "cuda_python": _version("cuda.bindings") or _version("cuda"),
        "cuda_ipc": ipc_ok,
        "cuda_ipc_detail": ipc_why,
        "mps": _mps() if cuda else None,
        "hold_cpu_awake": _cpu_awake(),
        "compiled_steps_kept": _kept_steps() if cuda else None,
        "pyzmq": _version("zmq"),
        "av": _version("av"),
        "opencv": _version("cv2"),
        "numpy": _version("numpy"),
        "presets": list_presets(),
    }


def _table(info: dict[str, Any]) -> str:
    rows = [(k, v) for k, v in info.items() if k not in ("gpus", "presets")]
    for g in info["gpus"]:
        rows.append((f"gpu {g['index']}", f"{g['name']}  {g['memory_gib']} GiB  sm_{g['capability']}  {g['uuid']}"))
    if not info["gpus"]:
        rows.append(("gpus", "none (the engine runs on the CPU)"))
    rows.append(("presets", ", ".join(info["presets"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {'-' if v is None else v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    if args.presets:
        print(json.dumps(list_presets()) if args.json else "\n".join(list_presets()))
        return 0
    info = collect()
    print(json.dumps(info, indent=2) if args.json else _table(info))
    return 0
