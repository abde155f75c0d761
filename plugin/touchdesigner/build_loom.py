"""Create the Loom component in a TouchDesigner network: run once from the Textport.

    from loom_live.plugin.touchdesigner.build_loom import build; build(op('/project1'))

It makes a Base COMP `loom` with an In TOP (and a second, `in2`, for a VACE control video), the
Script TOP `loom_top` (callbacks in the DAT `loom_callbacks`, not the Script TOP's own docked
`loom_top_callbacks`), a Switch TOP that shows the input while the component is inactive, an Out
TOP, the extension DAT `loom_ext`, a Parameter Execute DAT watching the control parameters, an
Execute DAT that cooks the Script TOP in each frame nothing else does while the engine runs, and the
Loom, Engine, LoRA, Control and Status pages. The callback DATs hold the text of this folder's
callback modules (TouchDesigner runs a DAT's text with `me` set); the extension DAT imports
`LoomExt`, so a `git pull` of Loom updates the component after Re-Init Extensions.
An existing operator of the same name is never replaced: pick another name or delete it first.
Run as a script outside TouchDesigner (`python build_loom.py`), it says where it is meant to run, exit 2,
rather than build nothing and exit 0 as if done; on a Python that cannot import Loom, it says so and where
TouchDesigner looks for it, exit 2, rather than end in an ImportError's traceback.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

try:
    from loom_live.plugin.touchdesigner.loom_ext import PAREXEC_PARS, SCRIPT_TOP
    from loom_live.plugin.touchdesigner.parameters import setup_parameters
except ImportError as exc:  # a shell's `python build_loom.py` on a Python without Loom on its path
    if __name__ != "__main__":
        raise
    print(f"build_loom.py: error: cannot import Loom ({exc}); this builds the Loom component inside TouchDesigner, "
          "whose Python finds Loom through its Preferences > General > Python 64-bit Module Path: add the Loom "
          "folder (the one holding host_bridge/ and plugin/) there (plugin/touchdesigner/README.md, step 2), then "
          "build it in TouchDesigner's Textport (step 3)", file=sys.stderr)
    sys.exit(2)

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
EXT_DAT = "loom_ext"
CALLBACKS_DAT = "loom_callbacks"  # not `<script TOP>_callbacks`: TD docks a DAT of that name on the Script TOP
PAREXEC_DAT = "loom_parexec"
EXECUTE_DAT = "loom_frames"
SWITCH_TOP = "loom_switch"
EXTENSION = f"op('./{EXT_DAT}').module.LoomExt(me)"
SWITCH_INDEX = "1 if parent().par.Active.eval() else 0"  # 0: the input, 1: Loom's output
TEXTPORT_LINE = "from loom_live.plugin.touchdesigner.build_loom import build; build(op('/project1'))"


def build(parent_comp: Any, name: str = "loom", td_module: Any = None) -> Any:
    """Create the Loom component inside `parent_comp` (a COMP) and return it.

    `td_module`: TouchDesigner's `td` module (its operator types); imported when not given.
    """
    if td_module is None:
        import td as td_module  # only inside TouchDesigner
    td = td_module
    if parent_comp.op(name) is not None:
        raise ValueError(f"{parent_comp.path}/{name} already exists; pass another name or delete it first")
    comp = parent_comp.create(td.baseCOMP, name)

    ext = comp.create(td.textDAT, EXT_DAT)
    ext.text = "from loom_live.plugin.touchdesigner.loom_ext import LoomExt  # noqa: F401\n"
    callbacks = comp.create(td.textDAT, CALLBACKS_DAT)
    callbacks.text = _source("script_top_callbacks.py")

    source = comp.create(td.inTOP, "in1")
    control = comp.create(td.inTOP, "in2")  # VACE: the control video (wire it, set Control Source to video)
    script = comp.create(td.scriptTOP, SCRIPT_TOP)
    script.par.callbacks = CALLBACKS_DAT
    script.inputConnectors[0].connect(source)
    script.inputConnectors[1].connect(control)
    switch = comp.create(td.switchTOP, SWITCH_TOP)
    switch.inputConnectors[0].connect(source)
    switch.inputConnectors[1].connect(script)
    switch.par.index.expr = SWITCH_INDEX
    out = comp.create(td.outTOP, "out1")
    out.inputConnectors[0].connect(switch)

    setup_parameters(comp)
    parexec = comp.create(td.parameterexecuteDAT, PAREXEC_DAT)
    parexec.text = _source("parexec_callbacks.py")
    parexec.par.op = ".."
    parexec.par.pars = PAREXEC_PARS
    parexec.par.valuechange = True
    parexec.par.onpulse = True
    frames = comp.create(td.executeDAT, EXECUTE_DAT)
    frames.text = _source("execute_callbacks.py")
    frames.par.framestart = True

    comp.par.extension1 = EXTENSION
    comp.par.promoteextension1 = True
    log.info("created %s: set Engine > Engine Python, then turn Active on", getattr(comp, "path", name))
    return comp


def _source(filename: str) -> str:
    return (HERE / filename).read_text(encoding="utf-8")


def outside_touchdesigner() -> int:
    """Say, on stderr, how the build is run (README step 3); the exit code of a shell's `python build_loom.py`."""
    print(f"build_loom.py: error: this builds the Loom component inside TouchDesigner, not from a shell; in "
          f"TouchDesigner's Textport (Dialogs > Textport and DATs) run: {TEXTPORT_LINE}  "
          "(plugin/touchdesigner/README.md, step 3)", file=sys.stderr)
    return 2


if __name__ == "__main__" and importlib.util.find_spec("td") is None:
    sys.exit(outside_touchdesigner())
