"""Loom's import namespace: `loom_live.engine`, `loom_live.host_bridge`, `loom_live.plugin`.

The folders keep their short names in the repository; installed, they live under this one name so
that a shared Python (ComfyUI's, TouchDesigner's) never mixes them up with another project's
`engine` or `plugin`. A host that puts a source checkout on sys.path (TouchDesigner, a ComfyUI
folder linked from the checkout, an engine launched with PYTHONPATH=checkout) imports this file
from the checkout, so the subpackages are looked up in the checkout's root as well.
"""

from pathlib import Path

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "engine" / "__main__.py").is_file():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)
