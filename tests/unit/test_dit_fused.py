"""The compiled elementwise ops of the DiT compute what the eager ones compute."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.graphs.dit_steps import GraphedStreamForward
from loom_live.engine.models.wan_dit import DIT_PRESETS, WanDiT
from loom_live.engine.models.wan_dit_ops import BlockOps


def _stream(model: WanDiT, chunks: list[torch.Tensor], ctx: torch.Tensor, graphed: bool = False) -> torch.Tensor:
    dev = chunks[0].device
    batch = chunks[0].shape[0]
    # adaptive sinks on: the sink scores run through the ops too
    cache = model.new_cache(batch, tuple(chunks[0].shape[3:]), num_kv_cache=3, sink=1, refresh_at=5,
                            sink_threshold=0.2, device=dev)
    cross = model.cross_kv(ctx)
    forward = GraphedStreamForward(model) if graphed else model.forward_stream
    t = torch.linspace(700.0, 300.0, batch, device=dev)
    outs = [forward(x, t, cache, cross) for x in chunks]
    return torch.cat(outs, dim=2)


def test_compiled_ops_match_eager_in_streaming_and_full_sequence():
    """Inductor on the CPU here; Triton on a GPU in the test below."""
    torch.manual_seed(0)
    model = WanDiT(DIT_PRESETS["tiny"]).eval()
    chunks = [torch.randn(1, 16, f, 4, 6) for f in (2, 1, 1, 1)]
    ctx = torch.randn(1, 5, 4096)
    with torch.no_grad():
        ref_stream = _stream(model, chunks, ctx)
        ref_full = model(torch.cat(chunks, 2), torch.tensor([600.0]), ctx, block_causal_frames=[2, 1, 1, 1])
        model.fuse_elementwise()
        assert model.blocks[0].ops.fused and model.blocks[0].self_attn.norm_q.ops.fused
        got_stream = _stream(model, chunks, ctx)
        got_full = model(torch.cat(chunks, 2), torch.tensor([600.0]), ctx, block_causal_frames=[2, 1, 1, 1])
    torch.testing.assert_close(got_stream, ref_stream, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_full, ref_full, rtol=1e-5, atol=1e-5)
    model.fuse_elementwise(BlockOps.eager())
    assert not model.head.ops.fused


def test_a_batch_of_one_reaches_the_compiled_ops_with_one_stride_per_shape():
    """The head's modulation against a block's, and a chunk's last frame of keys at two chunk lengths: the
    same shapes, strides apart only in their size-1 batch dimension. The compiled functions see one
    signature (one graph each, not one per call site), and a write through the view lands in the tensor."""
    from loom_live.engine.models.wan_dit_ops import _with_unit_strides, unit_strides

    block_mod, head_mod = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 2, 8)
    one, two = torch.randn(1, 1, 4, 2, 8), torch.randn(1, 2, 4, 2, 8)
    pairs = [(block_mod[:, :, 1], head_mod[:, :, 1]), (one[:, -1], two[:, -1])]
    for a, b in pairs:
        assert a.shape == b.shape and a.stride() != b.stride()
        assert unit_strides(a).stride() == unit_strides(b).stride()
        assert torch.equal(unit_strides(a), a) and unit_strides(a).data_ptr() == a.data_ptr()
    frames = []

    def counting(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    double = torch.compile(lambda x: x * 2, backend=counting, fullgraph=True)
    for a, b in pairs:
        torch._dynamo.reset()
        frames.clear()
        assert torch.equal(_with_unit_strides(double, a), a * 2) and torch.equal(_with_unit_strides(double, b), b * 2)
        assert len(frames) == 1
    view = unit_strides(two[:, -1])
    view.fill_(3.0)
    assert bool((two[:, -1] == 3.0).all()) and not bool((two[:, 0] == 3.0).any())


@pytest.mark.gpu
@pytest.mark.parametrize("batch, gelu_epilogue", [(1, True), (2, True), (1, False)])
def test_compiled_ops_inside_cuda_graphs_match_eager_bf16(batch, gelu_epilogue):
    """A 2-frame first chunk, then steady 1-frame chunks replayed as graphs; B=2 shares RoPE rows;
    the FFN's GELU in its matmul's epilogue or as a pass of its own (`model.gelu_epilogue`)."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(dev):
        model = WanDiT(DIT_PRESETS["tiny"]).to(torch.bfloat16).eval()
    chunks = [torch.randn(batch, 16, f, 8, 8, device=dev) for f in [2] + [1] * 12]
    ctx = torch.randn(1, 16, 4096, device=dev)
    with torch.inference_mode():
        ref = _stream(model, chunks, ctx).float()
        model.fuse_elementwise(BlockOps.compiled(gelu_epilogue=gelu_epilogue))
        got = _stream(model, chunks, ctx, graphed=True).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
