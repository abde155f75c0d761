"""Loom nodes for ComfyUI: start or connect to a Loom engine, set prompt and parameters, stream IMAGE batches.

Install: from the Comfy registry or ComfyUI-Manager (which installs Loom, `loom-live`, the declared
dependency), or link this folder from a Loom checkout into `ComfyUI/custom_nodes/` (it then finds
the rest of Loom through the link), or copy it and `pip install loom-live` into ComfyUI's Python.
The engine runs in its own process (any Python with torch and Loom), started by the Engine node.
"""

from __future__ import annotations

import sys
from pathlib import Path

INSTALL_HINT = ("the Loom nodes need Loom itself (the `loom-live` package) in ComfyUI's Python: "
                "pip install loom-live (or pip install -e /path/to/loom), or link this folder from a Loom "
                "checkout into ComfyUI/custom_nodes")


def _find_loom() -> None:
    """Import Loom's host side, from the installed package or a checkout this folder is linked from."""
    try:
        import host_bridge  # noqa: F401
        import host_bridge.wire.params  # noqa: F401
        return
    except ImportError:
        pass
    # Linked into custom_nodes: the Loom checkout is two folders above the real location of this file.
    root = str(Path(__file__).resolve().parents[2])
    if (Path(root) / "host_bridge").is_dir() and root not in sys.path:
        sys.path.insert(0, root)
    try:
        import host_bridge  # noqa: F401
        import host_bridge.wire.params  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{INSTALL_HINT} ({exc})") from None


_find_loom()

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
