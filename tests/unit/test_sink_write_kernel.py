"""The sink merge as a masked write: what `kv_cache.merge_sinks` writes for hits in any slot, none and
several rows, with the frame as a strided view of one q/k/v product, with and without the RoPE time
shift of the keys; in Triton's interpreter on a CPU (where triton is installed; its bf16 casts truncate,
so the rotated channels are checked to one bf16 step there), on a GPU (gpu marker), and the fallback
where the kernel does not apply."""

from __future__ import annotations

import textwrap

import pytest
import torch

from loom_live.engine.cache.kv_cache import merge_sinks
from loom_live.engine.cache.sink_write_kernel import masked_merge
from tests.triton_child import run_triton


def _case(device: str, seed: int, rows: int = 2, window: int = 6, sinks: int = 3, tokens: int = 10,
          heads: int = 4, dim: int = 8, dt: int = 4):
    """Caches, the frame (strided views of one q/k/v product, as the DiT has it) and a time shift: cos and
    sin [rows, dt] of one angle per channel pair, as the RoPE tables have them."""
    g = torch.Generator(device=device).manual_seed(seed)
    kc, vc = (torch.randn(rows, window, tokens, heads, dim, generator=g, device=device).to(torch.bfloat16)
              for _ in range(2))
    qkv = torch.randn(rows, tokens, 3, heads, dim, generator=g, device=device).to(torch.bfloat16)
    angle = (torch.rand(rows, dt // 2, generator=g, device=device) * 6.3).repeat_interleave(2, dim=-1)
    return kc, vc, qkv[:, :, 1], qkv[:, :, 2], (angle.cos(), angle.sin())


def _refresh(k_new: torch.Tensor) -> torch.Tensor:
    """The keys as the `refresh` policy hands them over: rotated, so a tensor of their own (the values
    stay a view of the product)."""
    return k_new.contiguous()


def _compare(got: torch.Tensor, ref: torch.Tensor, dt: int, step: float) -> bool:
    """The channels past dt equal; the rotated ones within `step` of their size (0: equal), plus, where
    the rotation's two terms nearly cancel, the float32 rounding of those terms (a fused multiply-add
    and two rounded products differ there by ~1e-8 on keys of size ~1)."""
    same = torch.equal(got[..., dt:], ref[..., dt:])
    d = (got[..., :dt].float() - ref[..., :dt].float()).abs()
    return same and bool((d <= step * ref[..., :dt].float().abs() + (2.0**-20 if step else 0.0)).all())


HITS = [[[False, True, False], [False, False, False]], [[False] * 3, [False] * 3],
        [[True, False, False], [False, False, True]]]

INTERPRETED = textwrap.dedent("""
    import torch
    from loom_live.engine.cache.kv_cache import merge_sinks
    from loom_live.engine.cache.sink_write_kernel import masked_merge
    from tests.unit.test_sink_write_kernel import HITS, _case, _compare, _refresh

    fell_back = []
    merge = masked_merge(lambda *a: fell_back.append(a), devices=("cpu",))
    # one program's tokens and channels, then several runs of tokens and channel blocks, the last ones partial
    for shape in ({}, {"tokens": 37, "heads": 80}):
        for seed, hit in enumerate(HITS):
            for turn in (False, True):
                kc, vc, k_new, v_new, shift = _case("cpu", seed, **shape)
                k_new, shift = (_refresh(k_new), shift) if turn else (k_new, None)
                ref_k, ref_v = kc.clone(), vc.clone()
                merge_sinks(ref_k[:, :3], ref_v[:, :3], k_new, v_new, torch.tensor(hit), shift)
                merge(kc[:, :3], vc[:, :3], k_new, v_new, torch.tensor(hit), shift)
                print(seed, turn, torch.equal(vc, ref_v) and _compare(kc, ref_k, 4, 2.0**-7 if turn else 0.0))
    print("fallback", len(fell_back))
""")


def test_the_masked_write_gives_the_merges_bytes_in_the_interpreter():
    lines = run_triton(INTERPRETED, interpret=True, timeout=240)
    assert lines[-1] == "fallback 0" and len(lines) == 4 * len(HITS) + 1
    assert all(line.endswith("True") for line in lines[:-1]), lines


def test_tensors_the_kernel_does_not_take_go_to_the_fallback():
    seen = []
    merge = masked_merge(lambda *a: seen.append(a))  # the kernel's devices: CUDA only
    kc, vc, k_new, v_new, shift = _case("cpu", 0)
    merge(kc[:, :3], vc[:, :3], k_new, v_new, torch.tensor(HITS[0]), shift)
    assert len(seen) == 1 and seen[0][2] is k_new and seen[0][5] is shift


@pytest.mark.gpu
@pytest.mark.parametrize("turn", [False, True])
@pytest.mark.parametrize("seed,hit", list(enumerate(HITS)))
def test_cuda_masked_write_gives_the_merges_bytes(seed, hit, turn):
    """At the 14B's frame (1560 tokens, 40 heads of 128, 44 time channels); the rotation may differ from
    the eager one by float32 contraction, now and then one bf16 step."""
    kc, vc, k_new, v_new, shift = _case("cuda", seed, tokens=1560, heads=40, dim=128, dt=44)
    k_new, shift = (_refresh(k_new), shift) if turn else (k_new, None)
    ref_k, ref_v = kc.clone(), vc.clone()
    merge_sinks(ref_k[:, :3], ref_v[:, :3], k_new, v_new, torch.tensor(hit, device="cuda"), shift)
    fell_back = []
    masked_merge(lambda *a: fell_back.append(a))(kc[:, :3], vc[:, :3], k_new, v_new,
                                                  torch.tensor(hit, device="cuda"), shift)
    assert not fell_back and torch.equal(vc, ref_v) and _compare(kc, ref_k, 44, 2.0**-7 if turn else 0.0)


def test_a_kernel_that_cannot_be_built_leaves_the_fallback_for_good(monkeypatch, caplog):
    """Its first launch raising (a Triton that cannot compile it) costs no merge and no stream: the
    fallback does that merge and every later one, and the reason is logged once."""
    from types import SimpleNamespace

    from loom_live.engine.cache import sink_write_kernel

    class Unbuildable:
        launches = 0

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                Unbuildable.launches += 1
                raise RuntimeError("PTX not supported by this toolkit")
            return launch

    monkeypatch.setattr(sink_write_kernel, "triton", SimpleNamespace(cdiv=lambda a, b: -(-a // b)))
    monkeypatch.setattr(sink_write_kernel, "_masked_write", Unbuildable(), raising=False)
    done = []
    merge = masked_merge(lambda *a: (done.append(a), merge_sinks(*a)), devices=("cpu",))
    kc, vc, k_new, v_new, shift = _case("cpu", 0)
    ref_k, ref_v = kc.clone(), vc.clone()
    for _ in range(3):
        merge(kc[:, :3], vc[:, :3], k_new, v_new, torch.tensor(HITS[0]), shift)
    merge_sinks(ref_k[:, :3], ref_v[:, :3], k_new, v_new, torch.tensor(HITS[0]), shift)
    assert Unbuildable.launches == 1 and len(done) == 3
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    assert caplog.text.count("could not run") == 1 and "PTX not supported" in caplog.text


STREAMED = textwrap.dedent("""
    import dataclasses, torch
    from loom_live.engine.cache.kv_cache import CacheOps, merge_sinks
    from loom_live.engine.cache.sink_write_kernel import masked_merge
    from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
    from loom_live.engine.models.wan_dit_ops import BlockOps

    torch.manual_seed(0)
    model = WanDiT(DIT_PRESETS["tiny"]).eval()
    calls = {"kernel": 0, "fallback": 0, "hits": 0}

    def fallback(*a):
        calls["fallback"] += 1
        merge_sinks(*a)

    kernel = masked_merge(fallback, devices=("cpu",))

    def counted(*a):
        calls["kernel"] += 1
        calls["hits"] += int(a[4].any() and a[5] is not None)  # a sink took a frame, its keys shifted
        kernel(*a)

    ctx = torch.randn(1, 8, 4096)
    chunks = [torch.randn(2, 16, f, 8, 8) for f in [2] + [1] * 7]
    outs = []
    for merge in (None, counted):
        ops = BlockOps.eager() if merge is None else dataclasses.replace(
            BlockOps.eager(), cache=CacheOps(merge_sinks=merge))
        model.fuse_elementwise(ops)
        cache, cross = model.new_cache(2, (8, 8), num_kv_cache=4, sink=2, refresh_at=5), model.cross_kv(ctx)
        t = torch.tensor([600.0, 600.0])
        with torch.inference_mode():
            outs.append(torch.cat([model.forward_stream(c, t, cache, cross) for c in chunks], 2))
    print(calls["hits"] > 0, calls["fallback"], torch.equal(outs[0], outs[1]))
""")


def test_a_stream_through_the_masked_write_equals_the_eager_stream_in_the_interpreter():
    """The real call path (the cache's sink update with the refresh policy's shift, two stream rows,
    keys and values as the blocks hand them over) in float32, where the interpreter rounds nothing."""
    lines = run_triton(STREAMED, interpret=True)
    assert lines[-1].split() == ["True", "0", "True"]


def test_the_masked_merge_is_a_setting_on_by_default():
    from loom_live.engine.config import load_config

    assert load_config("tiny-random").model.masked_sink_merge is True
    assert load_config("tiny-random", ["model.masked_sink_merge=false"]).model.masked_sink_merge is False


@pytest.mark.gpu
def test_cuda_stream_with_the_masked_merge_follows_the_compiled_merge():
    """A two-row bf16 stream with the refresh policy's shifts and sinks replaced on the way: the compiled
    block ops with the masked write give the compiled merge's frames (up to the rotation's contraction)."""
    from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
    from loom_live.engine.models.wan_dit_ops import BlockOps

    dev = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(dev):
        model = WanDiT(DIT_PRESETS["tiny"]).to(torch.bfloat16).eval()
    chunks = [torch.randn(2, 16, f, 8, 8, device=dev) for f in [2] + [1] * 12]
    ctx, t = torch.randn(1, 8, 4096, device=dev), torch.tensor([600.0, 600.0], device=dev)
    outs = []
    with torch.inference_mode():
        for masked in (False, True):
            model.fuse_elementwise(BlockOps.compiled(masked_sink_merge=masked))
            cache, cross = model.new_cache(2, (8, 8), num_kv_cache=4, sink=2, refresh_at=5), model.cross_kv(ctx)
            outs.append(torch.cat([model.forward_stream(c, t, cache, cross) for c in chunks], 2).float())
    assert ((outs[1] - outs[0]).norm() / outs[0].norm()).item() < 1e-2
