"""The host side of Loom: frames to and from the engine process, without torch.

Imported inside host applications (TouchDesigner, ComfyUI, the Loom player). Depends on numpy and
pyzmq; cuda-python only for the cuda-ipc transport, imported when that transport is used.
"""

from loom_live.host_bridge.client import Bridge, BridgeStatus, EngineRefused
from loom_live.host_bridge.config import BridgeConfig
from loom_live.host_bridge.newest_frames import DeviceFrame
from loom_live.host_bridge.supervisor import EngineState
from loom_live.host_bridge.wire.protocol import PROTOCOL_VERSION, ProtocolError, RingSpec

__all__ = ["Bridge", "BridgeConfig", "BridgeStatus", "DeviceFrame", "EngineRefused", "EngineState", "PROTOCOL_VERSION",
           "ProtocolError", "RingSpec"]
