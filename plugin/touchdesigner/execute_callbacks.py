"""Execute DAT callbacks for the Loom component: the Script TOP cooks every frame while it runs.

TouchDesigner cooks a node only when something asks for it and something changed (derivative.ca,
"Cook"). The engine's output for input N arrives after cook N, so with a still or paused input, or
nothing viewing the output, new engine frames would never appear. `build_loom.py` puts this text in
an Execute DAT inside the component with Frame Start on; TouchDesigner gives the DAT's module `me`.
"""

from __future__ import annotations


def onFrameStart(frame: int) -> None:
    me.parent().ext.LoomExt.OnFrameStart()  # noqa: F821 - TouchDesigner sets `me` in the DAT's module
