"""Frame rings: N slots of one frame each, one direction, over shm, cuda-ipc or tcp.

`base` declares the interface and the writer's slot bookkeeping; one module per transport;
`factory` picks the transport by name. This package re-exports the names callers use.
"""

from loom_live.host_bridge.wire.rings.base import Ring, SlotTracker, TransportUnavailable, packed_pitch
from loom_live.host_bridge.wire.rings.factory import attach_ring, create_ring

__all__ = ["Ring", "SlotTracker", "TransportUnavailable", "attach_ring", "create_ring", "packed_pitch"]
