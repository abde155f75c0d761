"""OSC In DAT callbacks: drive the Loom component with the same OSC addresses as `loom play`.

Put an OSC In DAT inside the Loom component, set its Network Port, and point its Callbacks DAT
at this file's DAT. Each message sets a component parameter, so OSC, the parameter dialog and
any expression binding all go the same way (through the Parameter Execute DAT to the engine).
"""

from __future__ import annotations

from typing import Any

ADDRESS_TO_PAR = {
    "/loom/prompt": "Prompt",
    "/loom/transition": "Transition",
    "/loom/steps": "Steps",
    "/loom/noise_scale": "Noisescale",
    "/loom/motion_aware": "Motionaware",
    "/loom/active": "Active",
}


def onReceiveOSC(dat: Any, rowIndex: int, message: str, byteData: bytes, timeStamp: float, address: str,
                 args: list, peer: Any) -> None:
    name = ADDRESS_TO_PAR.get(address.rstrip("/"))
    if name is None or not args:
        return
    setattr(dat.parent().par, name, args[0])
