"""Where Loom runs from: a source checkout, or an installed package.

Torch-free and at the bottom of the layers: the host's launcher puts a checkout on the engine's path, and
`loom train` writes its files into the checkout (an installed package's folder is no place to write).
"""

from __future__ import annotations

from pathlib import Path


def loom_checkout(package_dir: Path | None = None) -> Path | None:
    """The source checkout this Loom was imported from (the folder holding `host_bridge/` and `engine/`, with
    the project's pyproject.toml), or None for an installed Loom."""
    root = (package_dir or Path(__file__).resolve().parents[1]).parent
    if (root / "engine" / "__main__.py").is_file() and (root / "pyproject.toml").is_file() \
            and root.name not in ("site-packages", "dist-packages"):
        return root
    return None
