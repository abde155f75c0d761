"""Parameter Execute DAT callbacks: forward the component's parameter changes to its LoomExt.

Set the DAT's OPs to the Loom component, Parameters to `*`, and turn on Value Change and On Pulse.
"""

from __future__ import annotations

from typing import Any


def onValueChange(par: Any, prev: Any) -> None:
    par.owner.ext.LoomExt.OnParValueChange(par, prev)


def onPulse(par: Any) -> None:
    par.owner.ext.LoomExt.OnPulse(par)
