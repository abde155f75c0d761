"""Create (host side) or attach (engine side) a ring of the named transport."""

from __future__ import annotations

from typing import Any

from loom_live.host_bridge.wire.protocol import RingSpec
from loom_live.host_bridge.wire.rings.base import Ring, packed_pitch
from loom_live.host_bridge.wire.rings.cuda import CudaRing
from loom_live.host_bridge.wire.rings.shm import ShmRing
from loom_live.host_bridge.wire.rings.tcp import TcpRing


def create_ring(transport: str, direction: str, *, slots: int, width: int, height: int, channels: int = 3,
                dtype: str = "uint8", generation: int = 0, **options: Any) -> Ring:
    """Allocate a ring (host side, the owner)."""
    base = dict(transport=transport, dir=direction, slots=slots, width=width, height=height, channels=channels,
                dtype=dtype, generation=generation)
    if transport == "shm":
        return ShmRing.create(**base, **options)
    if transport == "tcp":
        return TcpRing(RingSpec(pitch=packed_pitch(width, channels, dtype), **base, **options))
    if transport == "cuda-ipc":
        return CudaRing.create(**base, **options)
    raise ValueError(f"transport: {transport!r} is not allowed; expected shm, cuda-ipc or tcp")


def attach_ring(spec: RingSpec) -> Ring:
    """Open a ring described by the peer (engine side)."""
    if spec.transport == "shm":
        return ShmRing.attach(spec)
    if spec.transport == "tcp":
        return TcpRing(spec)
    return CudaRing.attach(spec)
