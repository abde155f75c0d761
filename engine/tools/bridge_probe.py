"""What the host bridge adds per frame: a round trip through a real pass-through engine process.

The session's own stages are timed inside the engine; what a host additionally pays is the
hand-off: its copy into an input slot, the notice, the engine's slot-to-slot copy, the notice
back and the copy out. A pass-through engine (`loom serve --passthrough`, launched by the
bridge as a host would) makes that the only work, so submit -> output back is the bridge's
cost. `loom bench` reports it as the `bridge` stage; `benchmarks/bench_ipc.py` uses the same
loops on their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loom_live.host_bridge import Bridge, BridgeConfig
from loom_live.host_bridge.wire.handoff_marks import MARKS

REPO_ROOT = Path(__file__).resolve().parents[2]  # engine/tools/ -> the checkout
ANSWER_TIMEOUT_S = 10.0  # a pass-through engine answers in milliseconds; this only catches a dead one


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = np.asarray(samples_s) * 1000.0
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "n": len(ms)}


def passthrough_bridge(transport: str) -> Bridge:
    """A bridge that launches a pass-through engine when started (`with` starts and closes it)."""
    return Bridge(BridgeConfig(transport=transport, passthrough=True, engine_cwd=str(REPO_ROOT)))


def _wait(bridge: Bridge, i: int) -> None:
    if not bridge.wait_for_output(bridge.last_seq, ANSWER_TIMEOUT_S):
        raise RuntimeError(f"bridge probe: no output for frame {i}: {bridge.status()}")


def _submitted(bridge: Bridge, t0_ns: int) -> int:
    """The frame just submitted; with handoff marks on, stamped as submitted at `t0_ns` and now waited for."""
    seq = bridge.last_seq
    MARKS.mark(seq, "host.submit", t0_ns)
    MARKS.mark(seq, "host.wait")
    return seq


def _pace(t0: float, period_s: float, busy: bool = False) -> None:
    """A host frame loop: the next frame comes `period_s` after this one began (0: at once). `busy` keeps
    the core working until then, as a renderer's loop does, instead of letting it sleep."""
    if busy:
        while time.perf_counter() - t0 < period_s:
            pass
        return
    rest = period_s - (time.perf_counter() - t0)
    if rest > 0:
        time.sleep(rest)


def handoff_host(bridge: Bridge, frame: np.ndarray, frames: int, warmup: int,
                 period_s: float = 0.0, busy: bool = False) -> tuple[dict[str, float], np.ndarray]:
    """Host arrays (shm or tcp): submit -> `latest()`, a frame every `period_s` (0: back to back);
    returns the timings and the last output."""
    samples, out = [], None
    for i in range(frames + warmup):
        t0 = time.perf_counter_ns()
        bridge.submit(frame)
        seq = _submitted(bridge, t0)
        _wait(bridge, i)
        MARKS.mark(seq, "host.latest")
        out, _ = bridge.latest()
        MARKS.mark(seq, "host.done")
        if i >= warmup:
            samples.append((time.perf_counter_ns() - t0) / 1e9)
        _pace(t0 / 1e9, period_s, busy)
    return percentiles(samples), out


@dataclass
class QueuedCopies:
    """A caller's stream for the bridge's copies, as the TouchDesigner operator hands its own: the copies are
    queued on it (`keep` owns the source meanwhile), and `wait` returns once the stream has run them."""

    stream: int
    keep: Any
    wait: Callable[[], None]


def handoff_device(bridge: Bridge, src_ptr: int, dst_ptr: int, pitch: int, width: int, height: int,
                   channels: int, dtype: str, frames: int, warmup: int, period_s: float = 0.0,
                   busy: bool = False, queued: QueuedCopies | None = None) -> dict[str, float]:
    """Device buffers (cuda-ipc): `submit_cuda` -> `latest_cuda` into the caller's buffer, a frame
    every `period_s` (0: back to back); with `queued`, both copies queued on the caller's stream and the
    handoff done once that stream has run them."""
    samples = []
    submit_on = {} if queued is None else {"stream": queued.stream, "keep": queued.keep}
    read_on = {"wait": True} if queued is None else {"stream": queued.stream, "wait": False}
    for i in range(frames + warmup):
        t0 = time.perf_counter_ns()
        bridge.submit_cuda(src_ptr, pitch, width, height, channels, dtype, **submit_on)
        seq = _submitted(bridge, t0)
        _wait(bridge, i)
        MARKS.mark(seq, "host.latest")
        bridge.latest_cuda(dst_ptr, pitch, **read_on)
        if queued is not None:
            queued.wait()
        MARKS.mark(seq, "host.done")
        if i >= warmup:
            samples.append((time.perf_counter_ns() - t0) / 1e9)
        _pace(t0 / 1e9, period_s, busy)
    return percentiles(samples)


def probe(transport: str, width: int, height: int, frames: int = 200, warmup: int = 20) -> dict[str, Any]:
    """The bridge's round trip for uint8 frames of width x height over `transport`: RGB host arrays
    on shm/tcp, RGBA device buffers (what a TouchDesigner TOP hands over) on cuda-ipc."""
    with passthrough_bridge(transport) as bridge:
        bridge.wait_running(60)
        if transport == "cuda-ipc":
            import torch

            src = torch.randint(0, 256, (height, width, 4), dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            torch.cuda.synchronize()
            timing = handoff_device(bridge, src.data_ptr(), dst.data_ptr(), width * 4, width, height, 4, "uint8",
                                    frames, warmup)
            exact = bool(torch.equal(src, dst))
        else:
            src = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
            timing, out = handoff_host(bridge, src, frames, warmup)
            exact = out is not None and np.array_equal(out, src)
    if not exact:
        raise RuntimeError(f"bridge probe: the {transport} round trip changed the frame")
    return {"transport": transport, "width": width, "height": height, **timing}
