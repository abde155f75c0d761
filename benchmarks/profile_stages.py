"""Profile one streaming DiT forward and one Wan VAE chunk encode/decode at the real shapes.

Prints the top CUDA kernels and CPU ops, so speed work starts from where the time goes. The
models run as the session runs them on CUDA (DiT: compiled elementwise ops; Wan VAE: cudnn
benchmark, channels-last, fused norms, `--upsample` as loading sets it), eagerly so the profiler sees each kernel.

    python benchmarks/profile_stages.py --json out/profile.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from loom_live.engine.layers.phase_upsample import UPSAMPLE_KINDS
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE
from loom_live.engine.stream.stage_timer import median_cuda_ms


def profile(fn, label: str, rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    print(f"\n=== {label}: by self CUDA time")
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=60))
    print(f"=== {label}: by CPU time")
    print(p.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--json")
    ap.add_argument("--upsample", choices=UPSAMPLE_KINDS, default="phase", help="the Wan decoder's upsampling form")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.backends.cudnn.benchmark = True
    result = {}
    with torch.inference_mode():
        with torch.device(dev):
            dit = WanDiT(DIT_PRESETS["wan2.1-1.3b"]).to(dt).eval()
        dit.fuse_elementwise()
        cache = dit.new_cache(1, frame_shape=(60, 104), device=dev, dtype=dt)
        cross = dit.cross_kv(torch.randn(1, 512, 4096, device=dev, dtype=dt))
        x = torch.randn(1, 16, 1, 60, 104, device=dev, dtype=dt)
        t = torch.full((1,), 700.0, device=dev)
        for _ in range(8):
            dit.forward_stream(x, t, cache, cross)

        def dit_step():
            dit.forward_stream(x, t, cache, cross)

        result["dit_ms"] = median_cuda_ms(dit_step, 20)
        t0 = time.perf_counter()
        for _ in range(10):
            dit_step()
        result["dit_host_ms"] = (time.perf_counter() - t0) * 100
        torch.cuda.synchronize()
        profile(dit_step, "DiT forward_stream B=1", args.rows)

        with torch.device(dev):
            vae = WanVAE(VAE_PRESETS["wan2.1"]).to(dt).eval()
        vae.use_upsample(args.upsample)
        vae.use_channels_last()
        vae.fuse_norms()
        cl = torch.channels_last_3d
        st = vae.new_stream_state()
        vae.encode_stream(torch.randn(1, 3, 5, 480, 832, device=dev, dtype=dt).contiguous(memory_format=cl), st)
        vae.decode_stream(torch.randn(1, 16, 2, 60, 104, device=dev, dtype=dt), st)
        px = torch.randn(1, 3, 4, 480, 832, device=dev, dtype=dt).contiguous(memory_format=cl)
        z = torch.randn(1, 16, 1, 60, 104, device=dev, dtype=dt)
        result["vae_encode_ms"] = median_cuda_ms(lambda: vae.encode_stream(px, st), 10)
        result["vae_decode_ms"] = median_cuda_ms(lambda: vae.decode_stream(z, st), 10)
        profile(lambda: vae.encode_stream(px, st), "VAE encode 4 frames", args.rows)
        profile(lambda: vae.decode_stream(z, st), "VAE decode 1 latent", args.rows)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
