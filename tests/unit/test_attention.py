"""engine/layers/attention.py: every path computes softmax(q k^T / sqrt(d)) v with the same mask meaning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom_live.engine.layers.attention import attention


def _reference(q, k, v, mask=None):
    """float32, straight from the definition, on [B, L, H, D]."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_equals_its_definition_on_a_cpu(dtype, masked):
    """bfloat16 takes its own CPU path (two products and a softmax, the scores rounded to bfloat16 once):
    its error stays within a few times the fused kernel's."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 96, 4, 64), torch.randn(2, 384, 4, 64), torch.randn(2, 384, 4, 64)
    mask = (torch.rand(2, 1, 96, 384) > 0.3) | (torch.arange(384) < 8) if masked else None  # no row all masked
    want = _reference(q, k, v, mask)
    got = attention(q.to(dtype), k.to(dtype), v.to(dtype), mask)
    assert got.dtype == dtype and got.shape == (2, 96, 4, 64)
    fused = F.scaled_dot_product_attention(*(t.to(dtype).transpose(1, 2) for t in (q, k, v)),
                                           attn_mask=mask).transpose(1, 2)
    err, fused_err = (got.float() - want).abs().max(), (fused.float() - want).abs().max()
    assert err <= max(4 * fused_err, 1e-5), (err, fused_err)
