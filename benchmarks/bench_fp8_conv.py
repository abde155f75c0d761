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
applied after the conv; one scale for both if cuDNN refuses the per-channel multiply).

    python benchmarks/bench_fp8_conv.py --json out/bench_fp8_conv.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_convs import SHAPES  # noqa: E402
from loom_live.engine.stream.stage_timer import median_cuda_ms  # noqa: E402

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantise(x: torch.Tensor, per_channel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (e4m3 tensor in x's memory format, float32 scale) with x ~= q * scale: one scale for the
    tensor, or one per index of the first dimension (a weight's output channels)."""
    dims = tuple(range(1, x.dim())) if per_channel else tuple(range(x.dim()))
    scale = x.abs().amax(dim=dims, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def cudnn_fp8_conv(cudnn, handle, x8: torch.Tensor, w8: torch.Tensor, padding: list[int], channels: int
                   ) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    """A built cuDNN graph: conv(x8, w8) * descale -> bf16, the descale one number (`channels` 1) or one
    per output channel; returns (run(descale) -> output, plan name)."""
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.BFLOAT16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    x, w = graph.tensor_like(x8), graph.tensor_like(w8)
    dim = [1, channels] + [1] * (x8.dim() - 2)
    stride = [channels, 1] + [1] * (x8.dim() - 2)
    descale = graph.tensor(name="descale", dim=dim, stride=stride, data_type=cudnn.data_type.FLOAT)
    conv = graph.conv_fprop(image=x, weight=w, padding=padding, stride=[1] * len(padding),
                            dilation=[1] * len(padding), compute_data_type=cudnn.data_type.FLOAT)
    y = graph.scale(input=conv, scale=descale)
    y.set_output(True).set_data_type(cudnn.data_type.BFLOAT16)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    out = torch.empty_strided(y.get_dim(), y.get_stride(), device=x8.device, dtype=torch.bfloat16)
    workspace = torch.empty(graph.get_workspace_size(), device=x8.device, dtype=torch.uint8)

    def run(scale: torch.Tensor) -> torch.Tensor:
        graph.execute({x: x8, w: w8, descale: scale.reshape(dim), y: out}, workspace, handle=handle)
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


def bench_shape(cudnn, handle, cin: int, cout: int, t: int, h: int, w: int, iters: int) -> dict:
    dev, cl3 = torch.device("cuda"), torch.channels_last_3d
    g = torch.Generator(device=dev).manual_seed(0)
    # a conv input after norm and SiLU: mostly small, a positive tail
    x = F.silu(torch.randn(1, cin, t + 2, h, w, device=dev, generator=g) * 1.5).to(torch.bfloat16)
    x = x.contiguous(memory_format=cl3)
    wt = (torch.randn(cout, cin, 3, 3, 3, device=dev, generator=g) / (27 * cin) ** 0.5).to(torch.bfloat16)
    wt = wt.contiguous(memory_format=cl3)
    row = {"cin": cin, "cout": cout, "frames": t, "h": h, "w": w, "gflop": 2 * cin * cout * 27 * t * h * w / 1e9}
    ref = F.conv3d(x, wt, padding=(0, 1, 1))
    row["bf16_3d_ms"] = median_cuda_ms(lambda: F.conv3d(x, wt, padding=(0, 1, 1)), iters)
    row["quantise_ms"] = median_cuda_ms(lambda: quantise(x), iters)
    x8, sx = quantise(x)
    x8 = x8.contiguous(memory_format=cl3)
    for form in ("3d", "taps"):
        for per_channel in (True, False):  # one weight scale per output channel first: cuDNN may refuse it
            scales = "per-channel" if per_channel else "per-tensor"
            try:
                row.update(_fp8_form(cudnn, handle, form, x8, sx, wt, ref, per_channel, iters))
                row[f"fp8_{form}_scales"] = scales
                break
            except Exception as exc:  # cuDNN refuses what it has no engine for: record why, go on
                row[f"fp8_{form}_{scales}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def _fp8_form(cudnn, handle, form: str, x8: torch.Tensor, sx: torch.Tensor, wt: torch.Tensor, ref: torch.Tensor,
              per_channel: bool, iters: int) -> dict:
    """The e4m3 conv's plan, error against `ref` and time: `3d` as the VAE runs it, or `taps`, one 2D conv
    over the three time taps stacked on channels (tap-major) with the frames as the batch."""
    w8, sw = quantise(wt, per_channel)
    descale = (sx * sw).reshape(-1)
    cout, t = wt.shape[0], x8.shape[2] - 2
    if form == "3d":
        x_in, w_in, padding = x8, w8.contiguous(memory_format=torch.channels_last_3d), [0, 1, 1]
    else:  # the copies on the bytes: not every copy kernel takes float8
        cl2, xb, wb = torch.channels_last, x8.view(torch.uint8), w8.view(torch.uint8)
        taps = torch.cat([xb[:, :, i:i + t] for i in range(3)], dim=1)  # [1, 3 cin, t, h, w]
        x_in = taps[0].transpose(0, 1).contiguous(memory_format=cl2).view(FP8)  # [t, 3 cin, h, w]
        w_in = wb.permute(0, 2, 1, 3, 4).reshape(cout, -1, 3, 3).contiguous(memory_format=cl2).view(FP8)
        padding = [1, 1]
    run, plan = cudnn_fp8_conv(cudnn, handle, x_in, w_in, padding, descale.numel())
    out = run(descale)
    got = out if form == "3d" else out.transpose(0, 1)[None]
    return {f"fp8_{form}_plan": plan, **{f"fp8_{form}_{k}": v for k, v in errors(got, ref).items()},
            f"fp8_{form}_ms": median_cuda_ms(lambda: run(descale), iters)}


def _cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "refused"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("needs a Hopper or newer CUDA GPU (cuDNN's FP8 convolutions)", file=sys.stderr)
        return 2
    try:
        import cudnn
    except ImportError:
        print("needs nvidia-cudnn-frontend (pip install nvidia-cudnn-frontend==1.16.0; on the GPU machine put "
              "its cp312 wheel in .whl/)", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    rows, seen = [], set()
    with torch.inference_mode():
        for label, *shape in SHAPES:
            if tuple(shape) not in seen:
                seen.add(tuple(shape))
                rows.append({"shape": label, **bench_shape(cudnn, handle, *shape, iters=args.iters)})
    dev = torch.cuda.get_device_name()
    print(f"\nWan VAE 3x3x3 convs, bf16 against e4m3 (cuDNN {cudnn.backend_version()}), {dev}, "
          f"torch {torch.__version__}")
    print(f"{'shape':<22} {'bf16 ms':>8} {'fp8 3d ms':>10} {'fp8 taps ms':>12} {'quantise ms':>12} "
          f"{'3d rel rms':>11} {'taps rel rms':>13}  weight scales (3d, taps)")
    for r in rows:
        print(f"{r['shape']:<22} {r['bf16_3d_ms']:>8.3f} {_cell(r, 'fp8_3d_ms', '10.3f'):>10} "
              f"{_cell(r, 'fp8_taps_ms', '12.3f'):>12} {r['quantise_ms']:>12.3f} "
              f"{_cell(r, 'fp8_3d_rel_rms', '11.4f'):>11} {_cell(r, 'fp8_taps_rel_rms', '13.4f'):>13}  "
              f"{r.get('fp8_3d_scales', '-')}, {r.get('fp8_taps_scales', '-')}")
    for r in rows:
        for key in (k for k in r if k.endswith("_error")):
            print(f"{r['shape']}: {key}: {r[key]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": dev, "cudnn": cudnn.backend_version(), "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
