"""The attention forms: the DiT's window in parts (`model.attention_splits`) and the VAE's wide head as matrix
products (`vae.attention`) compute the plain attention."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.config import ConfigError, load_config
from loom_live.engine.layers import attention as attention_module
from loom_live.engine.layers.attention import attention, attention_lse, merge_partials, split_attention
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.engine.models.wan_dit_ops import BlockOps


def _qkv(batch=2, lq=10, lk=36, heads=3, dim=16, dtype=torch.float32, device="cpu", key_scale=1.0):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, lq, heads, dim, generator=g)
    k = torch.randn(batch, lk, heads, dim, generator=g) * key_scale
    v = torch.randn(batch, lk, heads, dim, generator=g)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))


def test_lse_is_the_log_sum_exp_of_the_scaled_scores():
    q, k, v = _qkv()
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out, lse = attention_lse(q, k, v)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    assert lse.dtype == torch.float32 and lse.shape == scores.shape[:-1]
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, scores.softmax(-1) @ v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [2, 3, 6])
def test_split_attention_equals_one_call(splits):
    q, k, v = _qkv()
    with torch.no_grad():
        torch.testing.assert_close(split_attention(q, k, v, splits=splits), attention(q, k, v),
                                   rtol=1e-5, atol=1e-5)


def test_merge_weights_parts_by_their_softmax_mass():
    """Keys scaled up make one part's scores dominate by tens of nats: the merge must neither overflow
    nor lose the small part (it is weighted by exp(lse) relative to the largest, in float32)."""
    q, k, v = _qkv(lk=12, key_scale=8.0)
    k[:, 6:] *= 0.01  # the second half holds almost no softmax mass
    with torch.no_grad():
        got = split_attention(q, k, v, splits=2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, attention(q, k, v), rtol=1e-5, atol=1e-5)
    one = torch.zeros(1, 2, 1, 1, 1)
    one[:, 1] = 1.0
    half = merge_partials(one, torch.tensor([[[[0.0]], [[0.0]]]]))  # equal mass: the mean of the parts
    assert half.item() == pytest.approx(0.5)


@pytest.mark.parametrize("case", ["uneven", "mask", "grad"])
def test_split_attention_falls_back_to_one_call(case, monkeypatch):
    """Where the parts are not defined (keys that do not split evenly, a masked window) or not wanted
    (autograd), the plain call runs, and so the plain result."""
    q, k, v = _qkv(lk=35 if case == "uneven" else 36)
    mask = torch.ones(1, 1, 1, k.shape[1], dtype=torch.bool) if case == "mask" else None
    if mask is not None:
        mask[..., :4] = False

    def refuse(*args):
        raise AssertionError("split into parts where the plain call was due")

    monkeypatch.setattr(attention_module, "attention_lse", refuse)
    with torch.set_grad_enabled(case == "grad"):
        got = split_attention(q, k, v, mask, splits=3)
    torch.testing.assert_close(got, attention(q, k, v, mask))


def _stream(model: WanDiT, chunks: list[torch.Tensor], ctx: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(chunks[0].shape[0], tuple(chunks[0].shape[3:]), num_kv_cache=6, sink=2, refresh_at=9,
                            sink_threshold=0.2)
    cross = model.cross_kv(ctx)
    t = torch.tensor([700.0])
    return torch.cat([model.forward_stream(x, t, cache, cross) for x in chunks], dim=2)


def _counting_lse(monkeypatch) -> list[int]:
    calls = []

    def counted(*args):
        calls.append(1)
        return attention_lse(*args)

    monkeypatch.setattr(attention_module, "attention_lse", counted)
    return calls


@pytest.mark.parametrize("compiled, splits", [(False, 2), (False, 3), (True, 3)],
                         ids=["eager-2", "eager-3", "compiled-3"])
def test_streaming_dit_with_the_window_in_parts_equals_without(compiled, splits, monkeypatch):
    """A stream past its window fill (masked chunks first, then unmasked ones that split) and past a RoPE
    refresh, with adaptive sinks: the ops with the attention in parts (the compiled ones merge with a
    compiled function) against the plain eager ones."""
    calls = _counting_lse(monkeypatch)
    torch.manual_seed(0)
    model = WanDiT(DIT_PRESETS["tiny"]).eval()
    # compiled: one chunk length throughout, so each op compiles once (a 2-frame chunk first doubles the compiles)
    chunks = [torch.randn(1, 16, f, 4, 6) for f in ([1] if compiled else [2]) + [1] * 10]
    ctx = torch.randn(1, 5, 4096)
    with torch.no_grad():
        ref = _stream(model, chunks, ctx)
        model.fuse_elementwise((BlockOps.compiled if compiled else BlockOps.eager)(attention_splits=splits))
        got = _stream(model, chunks, ctx)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert len(calls) >= 5 * len(model.blocks)  # the chunks after the window filled ran in parts


def test_splits_that_do_not_divide_the_window_fail_at_load():
    with pytest.raises((ConfigError, ValueError), match=r"attention_splits: 4 does not divide "
                                                        r"stream.num_kv_cache \(6\); allowed: 1, 2, 3, 6"):
        load_config("tiny-random", ["model.attention_splits=4", "stream.num_kv_cache=6"])
    cfg = load_config("tiny-random", ["model.attention_splits=3", "stream.num_kv_cache=6"])
    assert cfg.model.attention_splits == 3
    with pytest.raises(ValueError, match="attention_splits"):
        BlockOps.eager(attention_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, splits", [(12, 2), (12, 3), (40, 2)])
def test_split_attention_on_cuda_equals_the_plain_call_bf16(heads, splits):
    """cuDNN's kernel with its log-sum-exps, at the 1-latent stream's shape (1560 queries, 6 frames of keys)."""
    q, k, v = _qkv(batch=1, lq=1560, lk=6 * 1560, heads=heads, dim=128, dtype=torch.bfloat16, device="cuda")
    with torch.inference_mode():
        ref = attention(q, k, v).float()
        got = split_attention(q, k, v, splits=splits).float()
    assert (got - ref).abs().max() < 2e-2 * ref.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_attention_equals_the_kernel(dtype):
    """The VAE's wide single head (`vae.attention=matmul`): float32 scores, so in bf16 the only extra
    rounding is the probabilities', as in the fused kernels."""
    from loom_live.engine.layers.attention import matmul_attention

    q, k, v = (t.squeeze(2) for t in _qkv(batch=2, lq=40, lk=40, heads=1, dim=48, dtype=dtype))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    got = matmul_attention(q, k, v)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_matmul_attention_on_cuda_at_the_vae_shape():
    """One frame of the mid block at 480x832: 6240 positions, one head of 384 channels, bf16."""
    from loom_live.engine.layers.attention import matmul_attention

    q, k, v = (t.squeeze(2) for t in _qkv(batch=1, lq=6240, lk=6240, heads=1, dim=384, dtype=torch.bfloat16,
                                          device="cuda"))
    with torch.inference_mode():
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
        got = matmul_attention(q, k, v).float()
    assert (got - ref).abs().max() < 2e-2 * ref.abs().max()
