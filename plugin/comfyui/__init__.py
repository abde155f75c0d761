"""Loom nodes for ComfyUI: start or connect to a Loom engine, set prompt and parameters, stream IMAGE batches.

Install: link or copy this folder into `ComfyUI/custom_nodes/` (a link keeps it next to the rest of
Loom, which it needs: `host_bridge`), or `pip install -e /path/to/loom` into ComfyUI's Python. The
engine itself runs in its own process (any Python with torch and Loom), started by the Engine node.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import host_bridge  # noqa: F401  (Loom installed into ComfyUI's Python)
except ImportError:
    # Linked into custom_nodes: the Loom checkout is two folders above the real location of this file.
    _root = str(Path(__file__).resolve().parents[2])
    if (Path(_root) / "host_bridge").is_dir() and _root not in sys.path:
        sys.path.insert(0, _root)

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
