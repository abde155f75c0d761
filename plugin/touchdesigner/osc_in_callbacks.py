"""OSC In DAT callbacks: drive the Loom component with `loom play`'s OSC addresses for the settings it has,
plus `/loom/transition` and `/loom/active` of its own.

Put an OSC In DAT inside the Loom component, set its Network Port, and point its Callbacks DAT
at this file's DAT. Each message sets a component parameter, so OSC, the parameter dialog and
any expression binding all go the same way (through the Parameter Execute DAT to the engine).
`/loom/lora/scale name f` sets the scale of the LoRA slot whose file has that name (the file name
without the extension), as the player's OSC does.
"""

from __future__ import annotations

from typing import Any

from loom_live.plugin.touchdesigner.parameters import lora_scale_par

ADDRESS_TO_PAR = {
    "/loom/prompt": "Prompt",
    "/loom/transition": "Transition",
    "/loom/steps": "Steps",
    "/loom/noise_scale": "Noisescale",
    "/loom/motion_aware": "Motionaware",
    "/loom/control/scale": "Controlscale",
    "/loom/control/source": "Controlsource",
    "/loom/active": "Active",
}


def onReceiveOSC(dat: Any, rowIndex: int, message: str, byteData: bytes, timeStamp: float, address: str,
                 args: list, peer: Any) -> None:
    address = address.rstrip("/")
    if address == "/loom/lora/scale" and len(args) >= 2:
        par = lora_scale_par(dat.parent(), str(args[0]))
        if par is not None:
            setattr(dat.parent().par, par.name, args[1])
        return
    name = ADDRESS_TO_PAR.get(address)
    if name is None or not args:
        return
    setattr(dat.parent().par, name, args[0])
