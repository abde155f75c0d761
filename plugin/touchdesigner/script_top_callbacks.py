"""Script TOP callbacks for the Loom component (set the Script TOP's Callbacks DAT to this file's DAT).

Thin on purpose: TouchDesigner calls these functions by name; the work and all state live in the
component's `LoomExt` extension, found from the Script TOP's parent, so re-saving this DAT or
re-initialising the extension never leaves a second engine behind.
"""

from __future__ import annotations

from typing import Any


def _ext(scriptOp: Any) -> Any:
    return scriptOp.parent().ext.LoomExt


def onSetupParameters(scriptOp: Any) -> None:
    """'Setup Parameters' pulse: build the custom pages on the component."""
    from loom_live.plugin.touchdesigner.parameters import setup_parameters

    setup_parameters(scriptOp.parent())


def onPulse(par: Any) -> None:
    _ext(par.owner).OnPulse(par)


def onCook(scriptOp: Any) -> None:
    _ext(scriptOp).Cook(scriptOp)
