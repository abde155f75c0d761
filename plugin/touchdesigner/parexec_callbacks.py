"""Parameter Execute DAT callbacks: forward the component's parameter changes to its LoomExt.

`build_loom.py` sets the DAT's OPs to the Loom component, its Parameters to the control parameters
(`loom_ext.PAREXEC_PARS`: not the status ones the cook writes, which would fire it every cook), and
turns on Value Change and On Pulse.
"""

from __future__ import annotations

from typing import Any


def onValueChange(par: Any, prev: Any) -> None:
    par.owner.ext.LoomExt.OnParValueChange(par, prev)


def onPulse(par: Any) -> None:
    par.owner.ext.LoomExt.OnPulse(par)
