"""Tiny VAE (TAEHV layout): published key names and shapes, streaming == one-shot, per-frame oracle."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from loom_live.engine.models.taehv import MemBlock, TGrow, TinyVAE, TPool

TOL = 1e-4


def _published_layout() -> dict[str, tuple[int, ...]]:
    """Key -> shape of TAEHV's taew2_1 file, written out from the layout description (not the model)."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(prefix, cin, cout, k=3, bias=True):
        shapes[f"{prefix}.weight"] = (cout, cin, k, k)
        if bias:
            shapes[f"{prefix}.bias"] = (cout,)

    def memblock(prefix, n):
        conv(f"{prefix}.conv.0", 2 * n, n)
        conv(f"{prefix}.conv.2", n, n)
        conv(f"{prefix}.conv.4", n, n)

    conv("encoder.0", 3, 64)
    for pool_index, stride in ((2, 2), (7, 2), (12, 1)):
        conv(f"encoder.{pool_index}.conv", 64 * stride, 64, k=1, bias=False)
        conv(f"encoder.{pool_index + 1}", 64, 64, bias=False)
        for i in range(pool_index + 2, pool_index + 5):
            memblock(f"encoder.{i}", 64)
    conv("encoder.17", 64, 16)
    conv("decoder.1", 16, 256)
    for first, n, n_next, grow in ((3, 256, 128, 1), (9, 128, 64, 2), (15, 64, 64, 2)):
        for i in range(first, first + 3):
            memblock(f"decoder.{i}", n)
        conv(f"decoder.{first + 4}.conv", n, n * grow, k=1, bias=False)
        conv(f"decoder.{first + 5}", n, n_next, bias=False)
    conv("decoder.22", 64, 3)
    return shapes


@pytest.fixture(scope="module")
def tiny() -> TinyVAE:
    torch.manual_seed(0)
    return TinyVAE().eval()


def test_keys_and_shapes_match_published_layout(tiny):
    state = {k: tuple(v.shape) for k, v in tiny.state_dict().items()}
    assert state == _published_layout()
    assert sum(k.startswith("decoder.") for k in state) == 64  # as in the released taew2_1 files


def test_loads_taehv_file(tmp_path, tiny):
    path = tmp_path / "taew2_1.safetensors"
    save_file({k: v.contiguous() for k, v in tiny.state_dict().items()}, str(path))
    loaded = TinyVAE.from_checkpoint(path, dtype=torch.float16)
    assert loaded.dtype == torch.float16
    assert all(torch.equal(v.half(), loaded.state_dict()[k]) for k, v in tiny.state_dict().items())


def _video(frames: int, size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.rand(1, 3, frames, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@torch.no_grad()
def test_stream_encode_equals_one_shot(tiny):
    x = _video(13)
    whole = tiny.encode(x)
    assert whole.shape == (1, 16, 4, 4, 4)
    state = tiny.new_stream_state()
    parts = [tiny.encode_stream(x[:, :, :5], state), tiny.encode_stream(x[:, :, 5:9], state),
             tiny.encode_stream(x[:, :, 9:], state)]
    assert [p.shape[2] for p in parts] == [2, 1, 1]
    assert (torch.cat(parts, dim=2) - whole).abs().max() < TOL


@torch.no_grad()
def test_stream_decode_equals_one_shot(tiny):
    z = torch.randn(1, 16, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    whole = tiny.decode(z)
    assert whole.shape == (1, 3, 13, 32, 32)
    state = tiny.new_stream_state()
    parts = [tiny.decode_stream(z[:, :, i:i + 1], state) for i in range(4)]
    assert [p.shape[2] for p in parts] == [1, 4, 4, 4]
    assert (torch.cat(parts, dim=2) - whole).abs().max() < TOL


def _frame_by_frame(blocks: torch.nn.Sequential, frames: list[torch.Tensor]) -> list[torch.Tensor]:
    """Oracle: push one frame at a time through the block graph (TAEHV's sequential semantics).

    A memory block sees the previous frame's input (zeros first), a pool waits for `stride`
    frames, a grow step emits `stride` frames, each continuing through the rest of the graph.
    """
    memory: dict[int, torch.Tensor] = {}
    pending: dict[int, list[torch.Tensor]] = {}
    out: list[torch.Tensor] = []

    def push(h: torch.Tensor, i: int) -> None:
        while i < len(blocks):
            block = blocks[i]
            if isinstance(block, MemBlock):
                past = memory.get(i, torch.zeros_like(h))
                memory[i] = h
                h = block(h, past)
            elif isinstance(block, TPool):
                pending.setdefault(i, []).append(h)
                if len(pending[i]) < block.stride:
                    return
                h = block.conv(torch.cat(pending.pop(i), dim=1))
            elif isinstance(block, TGrow):
                for part in block.conv(h).chunk(block.stride, dim=1):
                    push(part, i + 1)
                return
            else:
                h = block(h.clone())  # in-place ReLUs must not touch the oracle's memory
            i += 1
        out.append(h)

    for frame in frames:
        push(frame, 0)
    return out


@torch.no_grad()
def test_matches_frame_by_frame_oracle(tiny):
    x = _video(9, size=16, seed=2)
    z = tiny.encode(x)
    pixels01 = ((x + 1) / 2)[0].transpose(0, 1)  # [T, 3, H, W]
    padded = [pixels01[:1]] * 3 + list(pixels01.split(1))  # Loom's start padding, see taehv.py
    z_oracle = torch.stack(_frame_by_frame(tiny.encoder, padded), dim=2)
    assert (z - z_oracle).abs().max() < TOL

    decoded = tiny.decode(z)
    frames = _frame_by_frame(tiny.decoder, list(z[0].transpose(0, 1).split(1)))[3:]
    oracle = torch.stack(frames, dim=2).clamp(0, 1) * 2 - 1
    assert decoded.shape == oracle.shape == (1, 3, 9, 16, 16)
    assert (decoded - oracle).abs().max() < TOL
    assert 0.05 < (decoded.abs() < 0.999).float().mean()


@torch.no_grad()
def test_stream_state_is_flat(tiny):
    state = tiny.new_stream_state()
    x = _video(1 + 4 * 6, size=16, seed=3)
    tiny.decode_stream(tiny.encode_stream(x[:, :, :5], state), state)
    size, ptrs = state.nbytes(), {k: v.data_ptr() for k, v in state.decoder.buffers.items()}
    for i in range(5, x.shape[2], 4):
        tiny.decode_stream(tiny.encode_stream(x[:, :, i:i + 4], state), state)
    assert state.nbytes() == size and ptrs == {k: v.data_ptr() for k, v in state.decoder.buffers.items()}


def test_normalize_switch(tiny):
    import dataclasses

    normed = TinyVAE(dataclasses.replace(tiny.cfg, normalize_on_encode=True)).eval()
    normed.load_state_dict(tiny.state_dict())
    x = _video(5, size=16, seed=4)
    with torch.no_grad():
        raw = tiny.encode(x)
        mean = torch.tensor(tiny.cfg.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(tiny.cfg.latents_std).view(1, -1, 1, 1, 1)
        assert torch.allclose(normed.encode(x), (raw - mean) / std, atol=1e-5)


@torch.no_grad()
def test_batch_rows_are_independent(tiny):
    """Frames of one video never leak into another's (time is folded into the batch internally)."""
    x = torch.cat([_video(5, size=16, seed=5), _video(5, size=16, seed=6)])
    z = tiny.encode(x)
    assert (z[1:] - tiny.encode(x[1:])).abs().max() < TOL
    out = tiny.decode(z)
    assert (out[:1] - tiny.decode(z[:1])).abs().max() < TOL
