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
# import name -> the distribution that provides it, for Loom's host-side dependencies
DISTRIBUTIONS = {"zmq": "pyzmq", "numpy": "numpy", "yaml": "pyyaml", "cv2": "opencv-python"}


def _find_loom() -> None:
    """Import Loom's host side, from the installed package or a checkout this folder is linked from."""
    try:
        import loom_live.host_bridge.client  # noqa: F401 (the bridge, with the numpy and pyzmq it imports)
        return
    except ImportError:
        pass
    # Linked into custom_nodes: the Loom checkout is two folders above the real location of this file.
    root = Path(__file__).resolve().parents[2]
    checkout = (root / "host_bridge").is_dir()
    if checkout and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        import loom_live.host_bridge.client  # noqa: F401
    except ImportError as exc:
        raise ImportError(_missing(exc, root if checkout else None)) from None


def _missing(exc: ImportError, checkout: Path | None) -> str:
    """What to install: Loom, or (found through the link) the dependency ComfyUI's Python lacks."""
    name = (getattr(exc, "name", None) or "").partition(".")[0]
    if checkout is None or name in ("", "loom_live"):
        return f"{INSTALL_HINT} ({exc})"
    dist = DISTRIBUTIONS.get(name, name)
    return (f"the Loom nodes found Loom's checkout at {checkout}, but ComfyUI's Python lacks {dist!r} ({exc}), "
            f"which Loom's host side needs: install it into ComfyUI's Python ({sys.executable} -m pip install "
            f"{dist}), or install the checkout with all its dependencies ({sys.executable} -m pip install -e "
            f"{checkout})")


_find_loom()

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS  # noqa: E402

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
