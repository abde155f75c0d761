"""RoPE tables against Wan2.1's complex-number formulation, and the position policies."""

from __future__ import annotations

import pytest
import torch

from loom_live.engine.layers.rope import RopeTables, axis_dims, refresh_shift, rotate, window_positions


def wan_reference_rope(x: torch.Tensor, f: int, h: int, w: int, start: int = 0) -> torch.Tensor:
    """Wan2.1's rope_apply written independently: complex float64 multiply per axis."""
    d = x.shape[-1]
    c = d // 2
    splits = [c - 2 * (c // 3), c // 3, c // 3]
    tables = []
    for n, size in zip(splits, (start + f, h, w)):
        freqs = 1.0 / 10000 ** (torch.arange(0, 2 * n, 2, dtype=torch.float64) / (2 * n))
        tables.append(
            torch.polar(
                torch.ones(size, n, dtype=torch.float64),
                torch.outer(torch.arange(size, dtype=torch.float64), freqs),
            )
        )
    grid = torch.cat(
        [
            tables[0][start : start + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            tables[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            tables[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(f * h * w, 1, -1)
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * grid).flatten(-2).float()


@pytest.mark.parametrize("head_dim", [12, 24, 128])
def test_tables_match_wan_complex_rope(head_dim):
    torch.manual_seed(0)
    f, h, w, start = 3, 4, 5, 7
    x = torch.randn(2, f * h * w, 3, head_dim)
    cos, sin = RopeTables(head_dim).grid(torch.arange(start, start + f), h, w)
    assert torch.allclose(rotate(x, cos, sin), wan_reference_rope(x, f, h, w, start), atol=1e-5)


def test_axis_split_is_wans():
    assert axis_dims(128) == (44, 42, 42)
    assert sum(axis_dims(24)) == 24
    with pytest.raises(ValueError, match="even"):
        axis_dims(13)


def test_time_rotations_compose_exactly():
    """Rotating a key at position p back by s gives the key at position p - s."""
    torch.manual_seed(0)
    rope = RopeTables(24)
    x = torch.randn(1, 6, 2, 24)
    at = lambda p: rotate(x, *rope.grid(torch.tensor([p]), 2, 3))  # noqa: E731
    cos, sin = rope.time_shift(torch.tensor(-37))
    dt = cos.shape[-1]
    moved = at(45).clone()
    moved[..., :dt] = rotate(moved[..., :dt], cos, sin)
    assert torch.allclose(moved, at(8), atol=1e-5)


def test_positions_outside_the_table_are_refused():
    with pytest.raises(ValueError, match="outside"):
        RopeTables(24).grid(torch.tensor([1023, 1024]), 2, 2)


def test_refresh_shift_policy():
    assert refresh_shift(next_pos=40, chunk_frames=1, kept_ring=2, sink=3, refresh_at=50) == 0
    # kept ring frames at 47, 48 move to 3, 4; the chunk follows at 5
    assert refresh_shift(next_pos=49, chunk_frames=2, kept_ring=2, sink=3, refresh_at=50) == 44
    with pytest.raises(ValueError, match="refresh_at"):
        refresh_shift(next_pos=6, chunk_frames=2, kept_ring=3, sink=3, refresh_at=7)


def test_window_positions_follow_age():
    # slots 0,1 sinks; ring slots 2..4 hold frames in age order 4, 2, 3
    assert window_positions(5, [0, 1], [4, 2, 3]) == [0, 1, 3, 4, 2]
