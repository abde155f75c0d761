"""The VAE stream cache's `through` and `commit`: a causal layer's input put together in its history buffer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom_live.engine.cache.vae_cache import FrameCache


def _conv(channels: int, seed: int = 0):
    weight = torch.randn(channels, channels, 3, 3, 3, generator=torch.Generator().manual_seed(seed))
    return lambda whole: F.conv3d(whole, weight, padding=(0, 1, 1))


def _chunks(sizes: list[int], channels: int = 4, seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, channels, t, 6, 6, generator=gen) for t in sizes]


@torch.no_grad()
@pytest.mark.parametrize("frames", [1, 2, 3])
@pytest.mark.parametrize("sizes", [[1, 4, 4, 4], [1, 2, 2], [1, 1, 1, 1], [4, 1, 8, 4, 2]])
def test_through_equals_the_concatenated_history(frames, sizes):
    """Each step's layer sees [last `frames` frames before it | this chunk], zeros at the start, for chunks
    of any length (shorter than the history too, where its frames overlap as they move at `commit`)."""
    def layer(whole: torch.Tensor) -> torch.Tensor:  # every output frame depends on the frames before it
        return whole.cumsum(dim=2)

    cache, seen = FrameCache(), torch.zeros(1, 4, frames, 6, 6)
    for x in _chunks(sizes):
        whole = torch.cat([seen, x], dim=2)
        assert torch.equal(cache.through("conv", x, frames, layer), layer(whole))
        cache.commit()
        seen = whole[:, :, -frames:]
        assert torch.equal(cache.buffers["conv"][:, :, :frames], seen)


@torch.no_grad()
def test_steady_steps_use_the_first_calls_buffer_in_place():
    """From a stream's first call (one frame) on, a step of up to one latent's frames finds room in the
    buffer it made: the layer reads that buffer's memory, nothing is allocated again (a compiled step or
    a captured graph keeps pointing at it), and a reset zeroes it in place."""
    cache, pointers = FrameCache(), []

    def layer(whole: torch.Tensor) -> torch.Tensor:
        pointers.append(whole.data_ptr())
        return whole.sum()

    for x in _chunks([1, 4, 4, 2, 1, 4]):
        cache.through("conv", x, 2, layer)
        cache.commit()
    buffer = cache.buffers["conv"]
    assert set(pointers) == {buffer.data_ptr()}
    cache.reset()
    assert cache.buffers["conv"] is buffer and not buffer.any()
    history = _chunks([1])[0]
    cache.through("conv", history, 1, layer)
    cache.commit()
    cache.through("conv", _chunks([8])[0], 1, layer)  # a longer step: a larger buffer, the history kept
    assert cache.buffers["conv"].shape[2] == 9 and torch.equal(cache.buffers["conv"][:, :, :1], history)


def test_a_compiled_step_writes_into_the_buffer_instead_of_a_copy():
    """Under Inductor the chunk is written into the buffer itself and the layer reads it there, also where
    the buffer has room left behind the chunk: no buffer of the window's size is made per step. The
    history moves after the step (`commit`)."""
    from torch._inductor.utils import run_and_get_code

    layer = _conv(8)
    for t in (4, 2):  # the window fills the buffer / leaves room behind it
        torch._dynamo.reset()
        cache = FrameCache()
        with torch.no_grad():
            cache.through("conv", torch.zeros(1, 8, 1, 6, 6), 2, layer)  # the stream's first call: eager
            cache.commit()
            step = torch.compile(lambda x, cache=cache: cache.through("conv", torch.sin(x), 2, layer))
            x = torch.randn(1, 8, t, 6, 6)
            expected = layer(torch.cat([cache.buffers["conv"][:, :, :2], torch.sin(x)], dim=2))
            got, codes = run_and_get_code(step, x)
            cache.commit()
        torch._dynamo.reset()
        assert torch.allclose(got, expected, atol=1e-5)
        sizes = ("(1, 8, 6, 6, 6)", f"(1, 8, {2 + t}, 6, 6)")  # the buffer's, the window's
        made = [line for code in codes for line in code.splitlines()
                if "empty_strided" in line and any(size in line for size in sizes)]
        assert not made, made
