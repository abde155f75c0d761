"""Where a chunk's GPU time goes: a kernel-level profile of steady streaming, per stream and per kernel.

A stream's chunk period on a GPU is set by the work of all its CUDA streams together (encode and
control on the side stream, the DiT on the denoise stream, the decode on its own), so a stage span
says little about what to make cheaper. This profiles a few steady chunks with the PyTorch profiler
(CUPTI sees the kernels inside CUDA graphs too) and sums kernel time per CUDA stream, per kernel
family and per kernel, plus the time the GPU was busy at all (kernels of all streams merged), all
per chunk: the busy time against the period says whether the GPU is saturated, the families say
whether convolutions, matrix products, attention or elementwise passes are worth the work.
"""

from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

# kernel name fragments (lower case) -> family; the first match wins
FAMILIES = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    ("convolution", ("conv", "implicit", "xmma_fprop", "wgrad", "dgrad", "fprop")),
    ("matmul", ("gemm", "nvjet", "cutlass", "matmul", "splitk")),
    ("copy", ("memcpy", "memset", "copy_", "cat", "direct_copy")),
    ("elementwise (aten)", ("elementwise", "vectorized", "reduce", "norm", "softmax", "upsample", "index")),
)


# the words of an Inductor kernel's name (`triton_poi_fused_cat_copy_0`) that only move data
MOVES = frozenset(("triton", "poi", "per", "red", "fused", "to", "copy", "slice", "cat", "as", "strided", "view",
                   "permute", "transpose", "clone", "unsqueeze", "squeeze", "select", "expand", "index", "new",
                   "zeros", "stack", "split", "reshape", "t", "scatter", "alias"))


def family(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_"):  # Inductor's kernels are named for the ops they fused, `convolution` among
        # them when a convolution's bias add was fused in: elementwise work, or a copy when they only move data
        words = [w for w in low.split("_") if w and not w.isdigit()]
        return "copy" if all(w in MOVES for w in words) else "elementwise (triton)"
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def profile_chunks(push_chunk: Callable[[int], None], chunks: int, sync: Callable[[], None],
                   top: int = 25) -> dict[str, Any]:
    """Profile `chunks` calls of `push_chunk(i)` (each pushes one chunk and lets the stream run);
    the summary's times are per chunk, in ms."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(chunks):
            push_chunk(i)
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    kernels = [(e["name"], int(e.get("args", {}).get("stream", -1)), float(e["ts"]), float(e["dur"]))
               for e in events if e.get("cat") == "kernel" and "dur" in e]
    return summarise(kernels, chunks, top)


def summarise(kernels: list[tuple[str, int, float, float]], chunks: int, top: int = 25) -> dict[str, Any]:
    """(name, stream, start us, duration us) per kernel -> per-chunk ms by stream, family and kernel."""
    if not kernels or chunks < 1:
        return {"chunks": chunks, "kernels": 0, "busy_ms": 0.0, "wall_ms": 0.0, "streams_ms": {},
                "families_ms": {}, "top": []}
    by_stream: dict[int, float] = defaultdict(float)
    by_family: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, stream, _, dur in kernels:
        by_stream[stream] += dur
        by_family[family(name)] += dur
        by_name[name][0] += dur
        by_name[name][1] += 1
    spans = sorted((start, start + dur) for _, _, start, dur in kernels)
    busy, (lo, hi) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > hi:
            busy, lo, hi = busy + hi - lo, start, end
        else:
            hi = max(hi, end)
    busy += hi - lo
    per = 1000.0 * chunks  # us in all -> ms per chunk
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "chunks": chunks,
        "kernels": len(kernels),
        "busy_ms": busy / per,
        "wall_ms": (spans[-1][1] - spans[0][0]) / per,
        "kernel_sum_ms": sum(by_stream.values()) / per,
        "streams_ms": {str(k): v / per for k, v in sorted(by_stream.items(), key=lambda kv: -kv[1])},
        "families_ms": {k: v / per for k, v in sorted(by_family.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n, "family": family(n), "ms": t / per, "calls": c / chunks} for n, (t, c) in ranked],
    }


def profile_table(p: dict[str, Any]) -> str:
    """The profile as lines for the bench's output."""
    lines = [f"profile: {p['chunks']} steady chunks, {p['kernels']} kernels; per chunk: kernels "
             f"{p.get('kernel_sum_ms', 0.0):.2f} ms summed over streams, GPU busy {p['busy_ms']:.2f} ms "
             f"of {p['wall_ms']:.2f} ms"]
    lines += [f"profile stream {s}: {ms:.2f} ms" for s, ms in p["streams_ms"].items()]
    lines += [f"profile family {f}: {ms:.2f} ms" for f, ms in p["families_ms"].items()]
    lines += [f"profile kernel {k['ms']:7.3f} ms x{k['calls']:5.1f} [{k['family']}] {k['name'][:110]}"
              for k in p["top"]]
    return "\n".join(lines)
