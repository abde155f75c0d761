"""The sink merge as a masked write (Triton): only the chosen sink slot's bytes are read and written.

Why: every block of every forward offers the chunk's last frame to the sinks (`kv_cache.merge_sinks`),
and mostly none takes it. Written as `copy_(where(hit, new, sinks))`, the compiled merge reads every
sink slot and the frame and writes every slot back, hit or not: for the 14B, three 16 MB slots of keys
and of values per block, about 200 MB a block, per forward. Here each program first reads its slot's
flag and loads and stores only under it, so a forward whose sinks keep their frames moves the flags
alone, and a hit moves one slot's keys and values. A program covers a run of tokens, not one: a launch
that mostly moves nothing costs its programs' start-up, which beside the VAE's convolutions is slow.
The RoPE time shift that moves a key to its sink's position (the `refresh` policy) is applied on the
way, to the stored channels only. The result is what `merge_sinks` writes (the rotated channels up to
float32 contraction in the rotation).

`masked_merge(fallback)` returns a merge with `merge_sinks`' signature that runs the kernel on CUDA
tensors whose channels (heads x head dim) are contiguous in each token, and `fallback` otherwise (a
CPU, another layout). Without triton it is `fallback` itself. (`devices` lets the tests run the kernel
on a CPU in Triton's interpreter.)
"""

from __future__ import annotations

import logging

import torch

from loom_live.engine.cache.kv_cache import MergeFn, Shift

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the compiled or eager merge runs instead
    triton = None

log = logging.getLogger(__name__)

BLOCK_T = 16  # tokens of one slot a program covers: few programs, since most find their slot not taken
BLOCK_C = 512  # channels of those tokens a program covers (the 1.3B's 1536 and the 14B's 5120 in whole blocks)
WARPS = 8

if triton is not None:

    @triton.jit
    def _masked_write(k_sinks, v_sinks, k_new, v_new, hit, cos, sin, sinks, tokens, channels, head_dim, dt,
                      sb, ss, st, kb, kt, vb, vt, ROTATE: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_C: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)  # one (row, slot, run of BLOCK_T tokens)
        runs = tl.cdiv(tokens, BLOCK_T)
        t = (r % runs) * BLOCK_T + tl.arange(0, BLOCK_T)
        slot = (r // runs) % sinks
        b = r // (runs * sinks)
        taken = tl.load(hit + b * sinks + slot).to(tl.int32)  # 0 or 1: this slot takes the frame
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (t[:, None] < tokens * taken) & (cols[None, :] < channels)
        # the frame's key and value may lie apart (rotated keys, a product's values)
        src = b * kb + t[:, None] * kt + cols[None, :]
        dst = b * sb + slot * ss + t[:, None] * st + cols[None, :]
        key = tl.load(k_new + src, mask=mask)
        if ROTATE:  # interleaved pairs of each head's first dt channels: (x0, x1) -> (x0 c - x1 s, x1 c + x0 s)
            d = cols % head_dim
            rotated = (d < dt) & (cols < channels)
            even = (d % 2) == 0
            c = tl.load(cos + b * dt + d, mask=rotated, other=1.0)[None, :]
            s = tl.load(sin + b * dt + d, mask=rotated, other=0.0)[None, :]
            turn = mask & rotated[None, :]
            partner = tl.load(k_new + src + tl.where(even, 1, -1)[None, :], mask=turn, other=0.0).to(tl.float32)
            turned = key.to(tl.float32) * c + tl.where(even[None, :], -partner, partner) * s
            key = tl.where(turn, turned.to(key.dtype), key)
        tl.store(k_sinks + dst, key, mask=mask)
        tl.store(v_sinks + dst, tl.load(v_new + b * vb + t[:, None] * vt + cols[None, :], mask=mask), mask=mask)


def _channels_contiguous(x: torch.Tensor) -> bool:
    """Heads x head dim (the last two dims) are one contiguous run in each token."""
    return x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def masked_merge(fallback: MergeFn, devices: tuple[str, ...] = ("cuda",)) -> MergeFn:
    """A sink merge (`kv_cache.merge_sinks`' signature and result) that writes only the hit slots of
    tensors on `devices`. If the kernel cannot be built (its first launch raises: a Triton that does not
    compile it), that is logged once and `fallback` does the merges from then on, so a stream goes on."""
    if triton is None:
        return fallback
    failed: list[str] = []  # the kernel's error once it failed to build

    def merge(k_sinks: torch.Tensor, v_sinks: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
              hit: torch.Tensor, shift: Shift | None = None) -> None:
        tensors = (k_sinks, v_sinks, k_new, v_new)
        if failed or not (k_sinks.device.type in devices and k_sinks.stride() == v_sinks.stride()
                          and all(map(_channels_contiguous, tensors)) and len({t.dtype for t in tensors}) == 1):
            fallback(k_sinks, v_sinks, k_new, v_new, hit, shift)
            return
        rows, sinks, tokens, _, head_dim = k_sinks.shape
        channels = k_sinks.shape[-2] * head_dim
        cos, sin = (t.float().contiguous() for t in shift) if shift is not None else (hit, hit)
        dt = cos.shape[-1] if shift is not None else 0
        grid = (rows * sinks * triton.cdiv(tokens, BLOCK_T), triton.cdiv(channels, BLOCK_C))
        try:
            _masked_write[grid](k_sinks, v_sinks, k_new, v_new, hit.contiguous().view(torch.uint8), cos, sin,
                                sinks, tokens, channels, head_dim, dt, *k_sinks.stride()[:3], *k_new.stride()[:2],
                                *v_new.stride()[:2], ROTATE=shift is not None, BLOCK_T=BLOCK_T,
                                BLOCK_C=BLOCK_C, num_warps=WARPS)
        except Exception as exc:  # built on first use: a Triton that cannot build it leaves the compiled merge
            failed.append(f"{type(exc).__name__}: {exc}")
            log.warning("sink merge: the masked Triton write could not run (%s); the compiled merge takes over",
                        failed[0][:300])
            fallback(k_sinks, v_sinks, k_new, v_new, hit, shift)

    return merge
