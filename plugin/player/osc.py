"""OSC control of the player (extra `osc`: python-osc), the way TouchDesigner and Resolume users drive things.

The server listens on UDP on its own thread and only queues `Command`s; the frame loop applies
them. A malformed message is counted and reported in the status line, never raised into the
server thread. python-osc is imported when a server is started, so the player runs without it.
Every refusal, made here or when the frame loop applies the command, is worded by `refusal`: it names
the address the performer sent, not the parameter's internal name.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any

from loom_live.host_bridge.wire.params import (
    ADAPTER_STRENGTH,
    CONTEXT_SCALE,
    CONTROL,
    LORA_SCALES,
    NOISE_SCALE,
    STEP_LISTS,
    TRANSITION_CHUNKS,
)
from loom_live.plugin.player.controls import (
    SETS_PARAM,
    Command,
    ControlError,
    Controls,
    adapter_strength_command,
    context_scale_command,
    control_source_command,
    lora_scale_command,
    noise_scale_command,
    prompt_command,
    reference_command,
    steps_command,
)

# address -> (arguments, what it does); the README's table is this one.
OSC_ADDRESSES: dict[str, tuple[str, str]] = {
    "/loom/prompt": ("text [transition_chunks]", "new prompt, blended over transition_chunks chunks"),
    "/loom/prompt/next": ("", "next prompt of the --prompts list"),
    "/loom/prompt/prev": ("", "previous prompt of the --prompts list"),
    "/loom/prompt/index": ("i", "prompt number i (0-based) of the --prompts list"),
    "/loom/steps": ("i", f"number of denoising steps, {min(STEP_LISTS)}..{max(STEP_LISTS)}"),
    "/loom/noise_scale": ("f", f"noise strength for a static scene, {NOISE_SCALE.min}..{NOISE_SCALE.max}"),
    "/loom/motion_aware": ("[0|1]", "motion-aware noise off / on (no argument: toggle)"),
    "/loom/lora/scale": ("name f", f"scale of the LoRA of that name, {LORA_SCALES.min:g}..{LORA_SCALES.max:g}"),
    "/loom/control/scale": ("f", f"VACE presets: control scale, {CONTEXT_SCALE.min:g}..{CONTEXT_SCALE.max:g} "
                                  "(0: the control video does not steer); the default preset: its edge scale"),
    "/loom/control/source": ("name", f"VACE presets: control source, one of {', '.join(CONTROL.choices)}"),
    "/loom/control/next": ("", "VACE presets: the next control source this run can make"),
    "/loom/reference": ("[path]", "VACE presets: a new reference image file, in effect at the next chunk "
                                  "(no path: none)"),
    "/loom/adapter_strength": ("f", f"edit presets: temporal adapter strength, {ADAPTER_STRENGTH.min:g}.."
                                    f"{ADAPTER_STRENGTH.max:g} (0: no temporal adapter)"),
    "/loom/pause": ("[0|1]", "pause / resume the input (no argument: toggle)"),
    "/loom/quit": ("", "stop the player; outputs are finalised"),
}


def _index(value: Any) -> Command:
    """A whole number (an OSC int, or a float such as 2.0 a fader sends); 1.7 is not rounded to a prompt."""
    whole = isinstance(value, float) and value.is_integer() or isinstance(value, int) and not isinstance(value, bool)
    if not whole:
        raise ControlError(f"prompt index: {value!r} is not a whole number")
    return Command("prompt_index", (int(value),))


ON, OFF = ("1", "true", "on", "yes", "t"), ("0", "false", "off", "no", "f")


def _toggle(name: str) -> Callable[..., Command]:
    """An on/off address: no argument flips it; one of 1/0, true/false (OSC's T/F), on/off sets it."""
    def build(*args: Any) -> Command:
        if not args:
            return Command(name, ())
        value = args[0]
        if len(args) == 1 and isinstance(value, bool):
            return Command(name, (value,))
        if len(args) == 1 and isinstance(value, (int, float)) and value in (0, 1):
            return Command(name, (bool(value),))
        if len(args) == 1 and isinstance(value, str) and value.strip().lower() in ON + OFF:
            return Command(name, (value.strip().lower() in ON,))
        raise ControlError(f"{name}: {list(args)!r} is not allowed; expected no argument (toggle), or one of 1 / 0, "
                           "true / false, on / off")
    return build


_BUILDERS: dict[str, Callable[..., Command]] = {
    "/loom/prompt": prompt_command,
    "/loom/prompt/next": lambda: Command("prompt_next"),
    "/loom/prompt/prev": lambda: Command("prompt_prev"),
    "/loom/prompt/index": _index,
    "/loom/steps": steps_command,
    "/loom/noise_scale": noise_scale_command,
    "/loom/motion_aware": _toggle("motion_aware"),
    "/loom/lora/scale": lora_scale_command,
    "/loom/control/scale": context_scale_command,
    "/loom/control/source": control_source_command,
    "/loom/control/next": lambda: Command("control_next"),
    "/loom/reference": reference_command,
    "/loom/adapter_strength": adapter_strength_command,
    "/loom/pause": _toggle("pause"),
    "/loom/quit": lambda: Command("quit"),
}


OSC_REFUSED = "OSC refused"
# The names the words shared with the keys and the page start a refusal with (the schema's, the commands', the
# builders'): an OSC refusal names the address sent in their place. transition_chunks stays, naming /loom/prompt's
# second argument.
_INTERNAL_NAMES = frozenset({*SETS_PARAM, *SETS_PARAM.values(), "lora scale", "prompt index", "reference", "pause"}
                            - {TRANSITION_CHUNKS.name})


def refusal(address: str, why: str) -> str:
    """A refusal of a message sent to `address`, as the performer reads it: `OSC refused /loom/control/scale: 5.0 is
    not allowed; expected a number in [0, 2]`, the schema's words for what is allowed kept."""
    name, sep, rest = why.partition(": ")
    return f"{OSC_REFUSED} {address}: {rest if sep and name in _INTERNAL_NAMES | {address} else why}"


def command_for(address: str, args: tuple[Any, ...], family: str | None = "wan") -> Command:
    """The command an OSC message asks for, refused (when applied) in `refusal`'s words; ControlError names the
    problem (a prompt's in the words of the model `family`)."""
    builder = _BUILDERS.get(address.rstrip("/"))
    if builder is None:
        raise ControlError(f"{address}: unknown OSC address; known: {', '.join(OSC_ADDRESSES)}")
    try:
        command = builder(*args, family=family) if builder is prompt_command else builder(*args)
    except TypeError:
        expected = OSC_ADDRESSES[address.rstrip("/")][0] or "no arguments"
        raise ControlError(f"{address}: wrong arguments {list(args)!r}; expected {expected}") from None
    return dataclasses.replace(command, refused_as=functools.partial(refusal, address))


class OSCServer:
    """A UDP OSC server feeding a `Controls` queue; `close()` stops it and frees the port."""

    def __init__(self, controls: Controls, host: str = "127.0.0.1", port: int = 9000) -> None:
        try:
            from pythonosc.dispatcher import Dispatcher
            from pythonosc.osc_server import ThreadingOSCUDPServer
        except ImportError as exc:
            raise RuntimeError("OSC control needs python-osc: pip install 'loom-live[osc]' "
                               "(or run without --osc-port)") from exc
        self.controls = controls
        self.received = 0
        self.rejected = 0
        self.last_error = ""
        dispatcher = Dispatcher()
        dispatcher.set_default_handler(self._handle)
        try:
            self._server = ThreadingOSCUDPServer((host, port), dispatcher)
        except OSError as exc:
            raise RuntimeError(f"OSC: cannot listen on udp {host}:{port}: {exc.strerror or exc}") from exc
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, name="loom-osc", daemon=True)
        self._thread.start()

    def _handle(self, address: str, *args: Any) -> None:
        self.received += 1
        try:
            self.controls.put(command_for(address, args, self.controls.state.family))
        except (ControlError, ValueError, TypeError) as exc:  # refused and counted; the stream goes on
            self.rejected += 1
            self.last_error = refusal(address, str(exc))
            self.controls.put(Command("refused", (self.last_error,)))  # said by the frame loop

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)
