"""The host side of Loom: frames to and from the engine process, without torch.

Imported inside host applications (TouchDesigner, ComfyUI, the Loom player). The bridge depends on numpy and
pyzmq; cuda-python only for the cuda-ipc transport, imported when that transport is used. The package itself
imports none of them: the names below are imported on first use, so a host whose Python lacks pyzmq (as
TouchDesigner's does until the user adds it) still loads the live-parameter schema (`wire.params`), builds its
controls from it, and says what to install when it starts an engine, instead of failing as it loads.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# each public name -> the module of this package that defines it
_HOMES = {"Bridge": "client", "BridgeConfig": "config", "BridgeStatus": "client", "DeviceFrame": "newest_frames",
          "EngineRefused": "client", "EngineState": "supervisor", "Interrupted": "client",
          "PROTOCOL_VERSION": "wire.protocol", "ProtocolError": "wire.protocol", "RingSpec": "wire.protocol"}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
