"""The sink merge as a masked write: the same bytes as `kv_cache.merge_sinks` for hits in any slot, none
and several rows, with the frame as a strided view of one q/k/v product; in Triton's interpreter on a CPU
(where triton is installed), on a GPU (gpu marker), and the fallback where the kernel does not apply."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from loom_live.engine.cache.kv_cache import merge_sinks
from loom_live.engine.cache.sink_write_kernel import masked_merge

ROOT = Path(__file__).resolve().parents[2]


def _case(device: str, seed: int, rows: int = 2, window: int = 6, sinks: int = 3, tokens: int = 10,
          heads: int = 4, dim: int = 8):
    g = torch.Generator(device=device).manual_seed(seed)
    kc, vc = (torch.randn(rows, window, tokens, heads, dim, generator=g, device=device).to(torch.bfloat16)
              for _ in range(2))
    qkv = torch.randn(rows, tokens, 3, heads, dim, generator=g, device=device).to(torch.bfloat16)
    return kc, vc, qkv[:, :, 1], qkv[:, :, 2]  # the frame as strided views of one product, as the DiT has it


HITS = [[[False, True, False], [False, False, False]], [[False] * 3, [False] * 3],
        [[True, False, False], [False, False, True]]]

INTERPRETED = textwrap.dedent("""
    import torch
    from loom_live.engine.cache.kv_cache import merge_sinks
    from loom_live.engine.cache.sink_write_kernel import masked_merge
    from tests.unit.test_sink_write_kernel import HITS, _case

    fell_back = []
    merge = masked_merge(lambda *a: fell_back.append(a), devices=("cpu",))
    for seed, hit in enumerate(HITS):
        kc, vc, k_new, v_new = _case("cpu", seed)
        ref_k, ref_v = kc.clone(), vc.clone()
        merge_sinks(ref_k[:, :3], ref_v[:, :3], k_new, v_new, torch.tensor(hit))
        merge(kc[:, :3], vc[:, :3], k_new, v_new, torch.tensor(hit))
        print(seed, torch.equal(kc, ref_k) and torch.equal(vc, ref_v))
    print("fallback", len(fell_back))
""")


def test_the_masked_write_gives_the_merges_bytes_in_the_interpreter():
    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["0", "True", "1", "True", "2", "True", "fallback", "0"]


def test_tensors_the_kernel_does_not_take_go_to_the_fallback():
    seen = []
    merge = masked_merge(lambda *a: seen.append(a))  # the kernel's devices: CUDA only
    kc, vc, k_new, v_new = _case("cpu", 0)
    merge(kc[:, :3], vc[:, :3], k_new, v_new, torch.tensor(HITS[0]))
    assert len(seen) == 1 and seen[0][2] is k_new


@pytest.mark.gpu
@pytest.mark.parametrize("seed,hit", list(enumerate(HITS)))
def test_cuda_masked_write_gives_the_merges_bytes(seed, hit):
    kc, vc, k_new, v_new = _case("cuda", seed, tokens=1560, heads=40, dim=128)  # the 14B's frame
    ref_k, ref_v = kc.clone(), vc.clone()
    merge_sinks(ref_k[:, :3], ref_v[:, :3], k_new, v_new, torch.tensor(hit, device="cuda"))
    fell_back = []
    masked_merge(lambda *a: fell_back.append(a))(kc[:, :3], vc[:, :3], k_new, v_new, torch.tensor(hit, device="cuda"))
    assert not fell_back and torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
