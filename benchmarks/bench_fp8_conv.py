"""Would FP8 convolutions shorten the Wan VAE? cuDNN's e4m3 conv against its bf16 conv, per conv shape.

With the full VAE the 1-step stream's period is the VAE's: its 3x3x3 convolutions already run near the
bf16 rate (`bench_convs.py`), so the only large step left is a narrower number format. torch has no FP8
convolution; cuDNN's graph API has one on Hopper, reached here through its Python frontend
(nvidia-cudnn-frontend, not a Loom dependency: on the GPU machine its wheel goes in .whl/ like pyzmq's).
For each distinct conv shape of a steady 4-frame chunk (`bench_convs.SHAPES`) this times:
  bf16 3d     F.conv3d as the VAE runs it (channels-last, cudnn benchmark mode)
  fp8 3d      cuDNN's conv over e4m3 input and weight, float32 accumulation, one descale, bf16 out
  fp8 taps    the same as one 2D conv over the three time taps stacked on channels (if 3D is refused)
  quantise    one pass turning the bf16 input into e4m3 (in a real path it would ride on the norm and
              SiLU that produce the conv's input; timed alone to bound what it costs)
and the FP8 result's error against bf16 (one scale for the input, one per output channel for the weight,
applied after the conv; one scale for both if the per-channel case fails).

Every case (a shape's bf16 and quantise timings; each form and weight scaling of its FP8 conv) runs in a
child process of its own (`--case`), which prints its result as one JSON line. A kernel's illegal memory
access poisons the CUDA context of its process: in one process it would take every later case with it,
and, being asynchronous, surface at some unrelated later call. In a child it costs only that case: the
child runs with CUDA_LAUNCH_BLOCKING=1, so the failing call is the one reported, and writes each stage it
enters to stderr; a child that crashes, exits non-zero or runs past --case-timeout becomes an error entry
in its shape's row (with the tail of its stderr) and the bench goes on. Times are taken under the same
setting (`--no-launch-blocking` times without it).

The graph's tensors are declared from the torch tensors' shapes, strides and dtypes, and before a graph
executes, the dims, strides and data types cuDNN will use for every tensor it reads or writes are checked
against the torch tensor bound to it and the storage behind it: a case with a mismatch is refused, not
run. What the frontend's `tensor_like` makes of the same tensors is recorded beside each case
(`fp8_<form>_<scaling>_tensor_like`).

    python benchmarks/bench_fp8_conv.py --json out/bench_fp8_conv.json
    python benchmarks/bench_fp8_conv.py --shapes 1 --case-timeout 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_convs import SHAPES  # noqa: E402
from loom_live.engine.stream.stage_timer import median_cuda_ms  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
FORMS = ("3d", "taps")
SCALINGS = ("per-channel", "per-tensor")  # per-tensor is tried only when per-channel failed
CASES = ("bf16",) + tuple(f"{form}/{scaling}" for form in FORMS for scaling in SCALINGS)
STDERR_TAIL = 300  # characters of a failed child's stderr kept in its error entry

# the cuDNN data type a torch dtype's memory holds, and the bytes of an element of each cuDNN type
CUDNN_TYPE = {"torch.float8_e4m3fn": "FP8_E4M3", "torch.float8_e5m2": "FP8_E5M2", "torch.bfloat16": "BFLOAT16",
              "torch.float16": "HALF", "torch.float32": "FLOAT", "torch.uint8": "UINT8", "torch.int8": "INT8"}
CUDNN_BYTES = {"FP8_E4M3": 1, "FP8_E5M2": 1, "UINT8": 1, "INT8": 1, "BFLOAT16": 2, "HALF": 2, "FLOAT": 4,
               "INT32": 4, "INT64": 8, "DOUBLE": 8}


# --- what a graph will touch against the torch tensors bound to it (pure Python, no GPU) ---

@dataclass(frozen=True)
class Binding:
    """One graph tensor next to the torch tensor handed to `graph.execute` for it."""
    name: str
    graph_dim: list[int]
    graph_stride: list[int]
    graph_type: str  # a cuDNN data type name, e.g. FP8_E4M3 (NOT_SET if the frontend did not set one)
    shape: list[int]
    stride: list[int]
    dtype: str  # str(torch dtype)
    nbytes: int  # bytes the tensor's storage holds from the tensor's first element on


def layout_mismatches(bindings: Iterable[Binding]) -> list[str]:
    """Every way a graph tensor differs from its torch tensor: dims, strides (of dims longer than 1; a
    length-1 dim's stride never moves the address), data type, and the last byte the graph's layout
    reaches against the bytes the storage holds. Empty when the graph can safely execute on them."""
    found = []
    for b in bindings:
        if list(b.graph_dim) != list(b.shape):
            found.append(f"{b.name}: graph dims {list(b.graph_dim)} != tensor shape {list(b.shape)}")
        elif [s for d, s in zip(b.graph_dim, b.graph_stride) if d > 1] != \
                [s for d, s in zip(b.shape, b.stride) if d > 1]:
            found.append(f"{b.name}: graph strides {list(b.graph_stride)} != tensor strides {list(b.stride)}")
        want = CUDNN_TYPE.get(b.dtype)
        if b.graph_type != want:
            found.append(f"{b.name}: graph data type {b.graph_type} != tensor {b.dtype} ({want})")
        size = CUDNN_BYTES.get(b.graph_type)
        if size is not None and len(b.graph_dim) == len(b.graph_stride) and all(d > 0 for d in b.graph_dim):
            reach = (1 + sum((d - 1) * abs(s) for d, s in zip(b.graph_dim, b.graph_stride))) * size
            if reach > b.nbytes:
                found.append(f"{b.name}: the graph's layout reaches {reach} bytes, the tensor's storage holds "
                             f"{b.nbytes}")
    return found


def conv_out_dims(x_dim: Sequence[int], w_dim: Sequence[int], padding: Sequence[int]) -> list[int]:
    """The output dims of a stride-1, dilation-1 convolution: [N, K, spatial + 2 pad - kernel + 1 ...]."""
    spatial = [x + 2 * p - k + 1 for x, k, p in zip(x_dim[2:], w_dim[2:], padding)]
    return [x_dim[0], w_dim[0], *spatial]


# --- the cases, each run in a child process (GPU) ---

_stage_now = "start"


def _stage(name: str) -> None:
    """Enter a stage: on stderr at once, so a child that dies shows how far it got."""
    global _stage_now
    _stage_now = name
    print(f"stage: {name}", file=sys.stderr, flush=True)


def quantise(x: torch.Tensor, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (e4m3 tensor in x's memory format, float32 scale) with x ~= q * scale: one scale for the
    tensor, or one per index of the first dimension (a weight's output channels)."""
    dims = tuple(range(1, x.dim())) if per_channel else tuple(range(x.dim()))
    scale = x.abs().amax(dim=dims, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def _dtype_name(data_type: object) -> str:
    return str(getattr(data_type, "name", data_type)).rsplit(".", 1)[-1]


def _binding(name: str, graph_tensor, tensor: torch.Tensor) -> Binding:
    nbytes = tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    return Binding(name, list(graph_tensor.get_dim()), list(graph_tensor.get_stride()),
                   _dtype_name(graph_tensor.get_data_type()), list(tensor.shape), list(tensor.stride()),
                   str(tensor.dtype), nbytes)


class LayoutMismatch(RuntimeError):
    """The graph would read or write memory other than the torch tensors bound to it hold."""


def _pygraph(cudnn, handle):
    return cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT, handle=handle)


def tensor_like_report(cudnn, handle, tensors: dict[str, torch.Tensor]) -> str:
    """What the frontend's `tensor_like` makes of these tensors (dims, strides, data type) against the
    tensors themselves: "matches", or the differences."""
    try:
        graph = _pygraph(cudnn, handle)
        found = layout_mismatches(_binding(n, graph.tensor_like(t), t) for n, t in tensors.items())
    except Exception as exc:  # the frontend may refuse a dtype outright: that is the finding
        return f"{type(exc).__name__}: {exc}"[:STDERR_TAIL]
    return "; ".join(found) or "matches"


def cudnn_fp8_conv(cudnn, handle, x8: torch.Tensor, w8: torch.Tensor, descale: torch.Tensor, padding: list[int]
                   ) -> tuple[Callable[[], torch.Tensor], str]:
    """A built cuDNN graph: conv(x8, w8) * descale -> bf16, the descale [1, 1, 1...] or [1, K, 1...]
    (one per output channel); returns (run() -> output, plan name). Raises LayoutMismatch, before anything
    executes, if what the graph will read or write differs from the tensors bound to it."""
    graph = _pygraph(cudnn, handle)
    fp8 = cudnn.data_type.FP8_E4M3
    x = graph.tensor(name="x", dim=list(x8.shape), stride=list(x8.stride()), data_type=fp8)
    w = graph.tensor(name="w", dim=list(w8.shape), stride=list(w8.stride()), data_type=fp8)
    channels = descale.numel()
    dim = [1, channels] + [1] * (x8.dim() - 2)
    stride = [channels, 1] + [1] * (x8.dim() - 2)  # what descale's memory is: contiguous, channels packed
    d = graph.tensor(name="descale", dim=dim, stride=stride, data_type=cudnn.data_type.FLOAT)
    conv = graph.conv_fprop(image=x, weight=w, padding=padding, stride=[1] * len(padding),
                            dilation=[1] * len(padding), compute_data_type=cudnn.data_type.FLOAT)
    y = graph.scale(input=conv, scale=d)
    y.set_output(True).set_data_type(cudnn.data_type.BFLOAT16)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    # every tensor graph.execute gets, made once and kept alive with the graph
    scale = descale.float().reshape(dim).contiguous()
    out = torch.empty_strided(y.get_dim(), y.get_stride(), device=x8.device, dtype=torch.bfloat16)
    _stage("layout check")
    found = layout_mismatches([_binding("x", x, x8), _binding("w", w, w8), _binding("descale", d, scale),
                               _binding("y", y, out)])
    expected = conv_out_dims(list(x8.shape), list(w8.shape), padding)
    if list(y.get_dim()) != expected:
        found.append(f"y: graph dims {list(y.get_dim())} != the conv's output {expected}")
    if found:
        raise LayoutMismatch("; ".join(found))
    workspace = torch.empty(graph.get_workspace_size(), device=x8.device, dtype=torch.uint8)
    pack = {x: x8, w: w8, d: scale, y: out}

    def run() -> torch.Tensor:
        graph.execute(pack, workspace, handle=handle)
        return out

    return run, _plan_name(graph)


def _plan_name(graph) -> str:
    try:
        return graph.get_plan_name_at_index(0)
    except (AttributeError, RuntimeError):
        return "?"


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    d = got.float() - ref.float()
    return {"rel_rms": (d.norm() / ref.float().norm()).item(),
            "rel_max": (d.abs().max() / ref.float().abs().max()).item()}


def make_inputs(cin: int, cout: int, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv's input (2 history frames + t) and weight, channels-last, the same in every child."""
    dev, cl3 = torch.device("cuda"), torch.channels_last_3d
    g = torch.Generator(device=dev).manual_seed(0)
    # a conv input after norm and SiLU: mostly small, a positive tail
    x = F.silu(torch.randn(1, cin, t + 2, h, w, device=dev, generator=g) * 1.5).to(torch.bfloat16)
    wt = (torch.randn(cout, cin, 3, 3, 3, device=dev, generator=g) / (27 * cin) ** 0.5).to(torch.bfloat16)
    return x.contiguous(memory_format=cl3), wt.contiguous(memory_format=cl3)


def bf16_case(shape: Sequence[int], iters: int) -> dict:
    """The bf16 conv as the VAE runs it, and the input's quantisation, in ms."""
    _stage("inputs")
    x, wt = make_inputs(*shape)
    torch.backends.cudnn.benchmark = True
    _stage("bf16 conv")
    ms = median_cuda_ms(lambda: F.conv3d(x, wt, padding=(0, 1, 1)), iters)
    _stage("quantise")
    return {"bf16_3d_ms": ms, "quantise_ms": median_cuda_ms(lambda: quantise(x), iters)}


def fp8_case(cudnn, handle, shape: Sequence[int], form: str, per_channel: bool, iters: int, notes: dict) -> dict:
    """The e4m3 conv's plan, error against bf16 and time: `3d` as the VAE runs it, or `taps`, one 2D conv
    over the three time taps stacked on channels (tap-major) with the frames as the batch. `notes` gets
    what `tensor_like` made of its inputs, kept even if the case then fails."""
    _stage("inputs")
    x, wt = make_inputs(*shape)
    ref = F.conv3d(x, wt, padding=(0, 1, 1))
    _stage("quantise")
    x8, sx = quantise(x)
    x8 = x8.contiguous(memory_format=torch.channels_last_3d)
    w8, sw = quantise(wt, per_channel)
    descale = (sx * sw).reshape(-1).contiguous()
    cout, t = wt.shape[0], x8.shape[2] - 2
    if form == "3d":
        x_in, w_in, padding = x8, w8.contiguous(memory_format=torch.channels_last_3d), [0, 1, 1]
    else:  # the copies on the bytes: not every copy kernel takes float8
        cl2, xb, wb = torch.channels_last, x8.view(torch.uint8), w8.view(torch.uint8)
        taps = torch.cat([xb[:, :, i:i + t] for i in range(3)], dim=1)  # [1, 3 cin, t, h, w]
        x_in = taps[0].transpose(0, 1).contiguous(memory_format=cl2).view(FP8)  # [t, 3 cin, h, w]
        w_in = wb.permute(0, 2, 1, 3, 4).reshape(cout, -1, 3, 3).contiguous(memory_format=cl2).view(FP8)
        padding = [1, 1]
    torch.cuda.synchronize()
    _stage("tensor_like")
    notes["tensor_like"] = tensor_like_report(cudnn, handle, {"x": x_in, "w": w_in})
    _stage("build")
    run, plan = cudnn_fp8_conv(cudnn, handle, x_in, w_in, descale, padding)
    _stage("execute")
    out = run()
    torch.cuda.synchronize()
    _stage("error")
    got = out if form == "3d" else out.transpose(0, 1)[None]
    errs = errors(got, ref)
    _stage("timing")
    return {f"fp8_{form}_plan": plan, **{f"fp8_{form}_{k}": v for k, v in errs.items()},
            f"fp8_{form}_ms": median_cuda_ms(run, iters)}


def child_main(case: str, shape: Sequence[int], iters: int) -> int:
    """One case in this process: its result, or the error it raised (with the stage it was in), as one
    JSON line on stdout."""
    notes: dict = {}
    try:
        with torch.inference_mode():
            if case == "bf16":
                result = bf16_case(shape, iters)
            else:
                form, scaling = case.split("/")
                _stage("cudnn")
                import cudnn

                handle = cudnn.create_handle()
                cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
                result = fp8_case(cudnn, handle, shape, form, scaling == "per-channel", iters, notes)
        payload = {"result": result, "notes": notes}
    except Exception as exc:  # cuDNN refuses what it has no engine for; a mismatch is refused here
        error = f"{_stage_now}: {type(exc).__name__}: {exc}"
        print(f"error: {error}", file=sys.stderr, flush=True)
        payload = {"error": error[:1000], "notes": notes}
    print(json.dumps(payload), flush=True)
    return 0


# --- the parent: one child per case, the row, the table ---

@dataclass
class Outcome:
    """A child's answer: its result, or why there is none; `notes` either way."""
    result: dict | None = None
    error: str | None = None
    notes: dict = field(default_factory=dict)


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _tail(stderr: str | bytes | None) -> str:
    return " | ".join(_text(stderr).strip()[-STDERR_TAIL:].splitlines())


def outcome_of(proc: subprocess.CompletedProcess | subprocess.TimeoutExpired) -> Outcome:
    """A finished (or timed-out) child as an Outcome: its JSON line's result or error; a timeout, a
    non-zero exit (a signal is a negative one) or no JSON line becomes an error with its stderr's tail."""
    if isinstance(proc, subprocess.TimeoutExpired):
        return Outcome(error=f"timed out after {proc.timeout:g} s: {_tail(proc.stderr)}")
    if proc.returncode != 0:
        return Outcome(error=f"crashed (exit {proc.returncode}): {_tail(proc.stderr)}")
    for line in reversed(_text(proc.stdout).splitlines()):
        try:
            payload = json.loads(line)
        except ValueError:
            continue
        if isinstance(payload, dict) and ("result" in payload or "error" in payload):
            notes = payload.get("notes") or {}
            if "error" in payload:
                return Outcome(error=str(payload["error"]), notes=notes)
            return Outcome(result=payload["result"], notes=notes)
    return Outcome(error=f"no result (exit 0): {_tail(proc.stderr)}")


def child_command(case: str, shape: Sequence[int], iters: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--case", case, "--shape", *map(str, shape),
            "--iters", str(iters)]


def run_case(case: str, shape: Sequence[int], iters: int = 20, timeout: float = 60.0, launch_blocking: bool = True,
             command: list[str] | None = None) -> Outcome:
    """Run one case in a child process (`command`, by default this file with --case) and read its answer;
    never raises for what the child does."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_LAUNCH_BLOCKING"}
    if launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    try:
        proc = subprocess.run(command or child_command(case, shape, iters), capture_output=True, text=True,
                              errors="replace", timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        return outcome_of(exc)
    return outcome_of(proc)


def _progress(label: str, case: str, outcome: Outcome) -> None:
    form, _, scaling = case.partition("/")
    status = "ok" if outcome.error is None else "error: " + " | ".join(outcome.error[:200].splitlines())
    print(f"bench_fp8_conv: {label} | {form} | {scaling or '-'} | {status}", file=sys.stderr, flush=True)


def bench_shape(label: str, shape: Sequence[int], run: Callable[[str, Sequence[int]], Outcome],
                progress: Callable[[str, str, Outcome], None] = _progress) -> dict:
    """One shape's row: the bf16 case, then per form the per-channel FP8 case and, only if that failed,
    the per-tensor one; a failed case leaves `fp8_<form>_<scaling>_error` and the next case runs."""
    cin, cout, t, h, w = shape
    row = {"shape": label, "cin": cin, "cout": cout, "frames": t, "h": h, "w": w,
           "gflop": 2 * cin * cout * 27 * t * h * w / 1e9}
    outcome = run("bf16", shape)
    progress(label, "bf16", outcome)
    if outcome.error is None:
        row.update(outcome.result or {})
    else:
        row["bf16_error"] = outcome.error
    for form in FORMS:
        for scaling in SCALINGS:
            outcome = run(f"{form}/{scaling}", shape)
            progress(label, f"{form}/{scaling}", outcome)
            row.update({f"fp8_{form}_{scaling}_{k}": v for k, v in outcome.notes.items()})
            if outcome.error is None:
                row.update(outcome.result or {})
                row[f"fp8_{form}_scales"] = scaling
                break
            row[f"fp8_{form}_{scaling}_error"] = outcome.error
    return row


def distinct_shapes(shapes: Iterable[Sequence] = SHAPES, limit: int | None = None) -> list[tuple[str, tuple]]:
    """(label, (cin, cout, frames, h, w)) for each shape not seen before, the first `limit` of them."""
    out, seen = [], set()
    for label, *shape in shapes:
        if tuple(shape) not in seen:
            seen.add(tuple(shape))
            out.append((label, tuple(shape)))
    return out if limit is None else out[:limit]


def _cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "-"


def print_table(rows: list[dict], meta: dict) -> None:
    print(f"\nWan VAE 3x3x3 convs, bf16 against e4m3 (cuDNN {meta['cudnn']}), {meta['device']}, "
          f"torch {meta['torch']}, CUDA_LAUNCH_BLOCKING={int(meta['launch_blocking'])}")
    print(f"{'shape':<22} {'bf16 ms':>8} {'fp8 3d ms':>10} {'fp8 taps ms':>12} {'quantise ms':>12} "
          f"{'3d rel rms':>11} {'taps rel rms':>13}  weight scales (3d, taps)")
    for r in rows:
        print(f"{r['shape']:<22} {_cell(r, 'bf16_3d_ms', '8.3f'):>8} {_cell(r, 'fp8_3d_ms', '10.3f'):>10} "
              f"{_cell(r, 'fp8_taps_ms', '12.3f'):>12} {_cell(r, 'quantise_ms', '12.3f'):>12} "
              f"{_cell(r, 'fp8_3d_rel_rms', '11.4f'):>11} {_cell(r, 'fp8_taps_rel_rms', '13.4f'):>13}  "
              f"{r.get('fp8_3d_scales', '-')}, {r.get('fp8_taps_scales', '-')}")
    for r in rows:
        for key in (k for k in r if k.endswith("_error") or k.endswith("_tensor_like")):
            print(f"{r['shape']}: {key}: {r[key]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="written again after each shape")
    ap.add_argument("--shapes", type=int, default=None, metavar="N", help="the first N distinct shapes only")
    ap.add_argument("--case-timeout", type=float, default=60.0, metavar="S",
                    help="seconds a case's child may run before it is killed and recorded as timed out")
    ap.add_argument("--no-launch-blocking", action="store_true",
                    help="children run without CUDA_LAUNCH_BLOCKING=1 (an illegal access then surfaces at "
                         "the case's next synchronisation)")
    ap.add_argument("--case", choices=CASES, default=None,
                    help="run this one case here and print its result as one JSON line (what each child does)")
    ap.add_argument("--shape", type=int, nargs=5, metavar=("CIN", "COUT", "T", "H", "W"), help="with --case")
    args = ap.parse_args(argv)
    if args.case is not None:
        if args.shape is None:
            ap.error("--case needs --shape")
        return child_main(args.case, args.shape, args.iters)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("needs a Hopper or newer CUDA GPU (cuDNN's FP8 convolutions)", file=sys.stderr)
        return 2
    try:
        import cudnn
    except ImportError:
        print("needs nvidia-cudnn-frontend (pip install nvidia-cudnn-frontend==1.16.0; on the GPU machine put "
              "its cp312 wheel in .whl/)", file=sys.stderr)
        return 2
    meta = {"device": torch.cuda.get_device_name(), "cudnn": cudnn.backend_version(), "torch": torch.__version__,
            "launch_blocking": not args.no_launch_blocking}
    run = partial(run_case, iters=args.iters, timeout=args.case_timeout, launch_blocking=meta["launch_blocking"])
    rows = []
    for label, shape in distinct_shapes(SHAPES, args.shapes):
        rows.append(bench_shape(label, shape, run))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({**meta, "rows": rows}, indent=2))
    print_table(rows, meta)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    code = main()
    if "--case" in sys.argv:  # a child: its JSON line is out; skip the teardown a poisoned context can crash
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)
