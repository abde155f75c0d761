"""The Loom component's custom parameters, declared once and built with TouchDesigner's page API.

TouchDesigner custom parameter names start with a capital letter followed by lower-case letters
or digits; `par.<Name>` reads them. Read-only parameters carry the engine status (state, FPS,
latency, drops, log tail) so a network can reference them like any other value.

The LoRA page has a fixed number of slots (as many LoRAs as an engine loads), each a file and a
scale: the files are start-up settings like the Engine page's, the scales are live. Fixed slots
rather than a sequence parameter, so the page builds the same way on every TouchDesigner build and
an expression or an OSC In CHOP can bind to `Lora2scale` by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loom_live.host_bridge.wire.params import (
    CONTROL,
    LIVE,
    LORA_DEFAULT_SCALE,
    LORA_SCALES,
    PROMPT,
    STEP_LISTS,
    lora_name,
)

PAGE_CONTROL = "Loom"
PAGE_ENGINE = "Engine"
PAGE_LORA = "LoRA"
PAGE_VACE = "Control"
PAGE_STATUS = "Status"
LORA_SLOTS = LORA_SCALES.max_len or 0
LORA_FILE_PARS = tuple(f"Lora{i}" for i in range(1, LORA_SLOTS + 1))
LORA_SCALE_PARS = tuple(f"Lora{i}scale" for i in range(1, LORA_SLOTS + 1))

TRANSPORT_MENU = ("cuda-ipc", "shm", "tcp")
FALLBACK_MENU = ("passthrough", "last")


@dataclass(frozen=True)
class ParSpec:
    """One custom parameter: TD style name, kind (Str, Int, Float, Toggle, Pulse, File, Menu), default."""

    name: str
    label: str
    kind: str
    page: str
    default: Any = None
    min: float | None = None
    max: float | None = None
    menu: tuple[str, ...] = ()
    read_only: bool = False
    help: str = ""


_PAR_KINDS = {"int": "Int", "float": "Float", "bool": "Toggle"}


def live_par(name: str, label: str, param: str, help: str = "", page: str = PAGE_CONTROL) -> ParSpec:
    """A Loom page parameter for one live parameter: kind, default and range from the schema (a slider
    stops at the schema's `ui_max` where the allowed maximum is far beyond useful values)."""
    p = LIVE[param]
    top = p.ui_max if p.ui_max is not None else p.max
    return ParSpec(name, label, _PAR_KINDS[p.kind], page, p.default, p.min, top, help=help or p.doc)


def lora_pars() -> tuple[ParSpec, ...]:
    """The LoRA page: per slot a file (read when the engine starts) and its live scale (range from the schema)."""
    top = LORA_SCALES.ui_max if LORA_SCALES.ui_max is not None else LORA_SCALES.max
    pars: list[ParSpec] = []
    for slot, (file, scale) in enumerate(zip(LORA_FILE_PARS, LORA_SCALE_PARS), 1):
        pars.append(ParSpec(file, f"LoRA {slot}", "File", PAGE_LORA, "",
                            help="a Wan2.1 LoRA file (.safetensors) for this model size; empty: none. Changing "
                                 "it restarts the engine"))
        pars.append(ParSpec(scale, f"LoRA {slot} Scale", "Float", PAGE_LORA, LORA_DEFAULT_SCALE, LORA_SCALES.min,
                            top, help=f"strength of LoRA {slot}, changed live ({LORA_SCALES.allowed_each()})"))
    return tuple(pars)


PARAMETERS: tuple[ParSpec, ...] = (
    ParSpec("Active", "Active", "Toggle", PAGE_CONTROL, False, help="start the engine and stream while on"),
    ParSpec("Prompt", "Prompt", "Str", PAGE_CONTROL, PROMPT.default),
    live_par("Transition", "Transition Chunks", "transition_chunks"),
    ParSpec("Steps", "Steps", "Int", PAGE_CONTROL, len(LIVE["steps"].default), min(STEP_LISTS), max(STEP_LISTS),
            help="denoising steps (1 = fastest)"),
    live_par("Noisescale", "Noise Scale", "noise_scale", help="how far from the input the style may go (static scene)"),
    live_par("Motionaware", "Motion Aware Noise", "motion_aware",
             help="less noise where the input moves (StreamDiffusionV2)"),
    ParSpec("Start", "Start", "Pulse", PAGE_CONTROL),
    ParSpec("Stop", "Stop", "Pulse", PAGE_CONTROL),
    ParSpec("Enginepython", "Engine Python", "File", PAGE_ENGINE, "",
            help="python executable of the environment with torch and Loom installed"),
    ParSpec("Config", "Config", "Str", PAGE_ENGINE, "default", help="preset name or YAML file"),
    ParSpec("Transport", "Transport", "Menu", PAGE_ENGINE, "cuda-ipc", menu=TRANSPORT_MENU),
    ParSpec("Endpoint", "Remote Endpoint", "Str", PAGE_ENGINE, "",
            help="empty: start a local engine; else tcp://127.0.0.1:port of one `loom serve --bind` runs"),
    ParSpec("Secretfile", "Secret File", "File", PAGE_ENGINE, "",
            help="with Remote Endpoint: the served engine's session secret (its loom serve --secret-file)"),
    ParSpec("Fallback", "Fallback", "Menu", PAGE_ENGINE, "passthrough", menu=FALLBACK_MENU,
            help="what to show while the engine starts or restarts"),
    ParSpec("Passthrough", "Passthrough Engine", "Toggle", PAGE_ENGINE, False,
            help="the engine returns its input unchanged: checks the wiring without a model"),
    ParSpec("Hotstandby", "Hot Standby", "Toggle", PAGE_ENGINE, False,
            help="keep a second engine loaded that takes over at once if the one in use stops (a crash, a hang); "
                 "costs a second engine's memory; a local engine only"),
    *lora_pars(),
    live_par("Controlscale", "Control Scale", "context_scale",
             help="VACE presets: how strongly the control video steers the structure; 0 = not at all",
             page=PAGE_VACE),
    ParSpec("Controlsource", "Control Source", "Menu", PAGE_VACE, CONTROL.default, menu=CONTROL.choices,
            help="VACE presets: the control video, made from the input (edges, grey, flow, depth) or the "
                 "component's second input (video)"),
    ParSpec("Referencetop", "Reference TOP", "TOP", PAGE_VACE, "",
            help="VACE presets: a TOP whose picture sets the look; read when set, at Update Reference and when "
                 "the engine starts; empty: none"),
    ParSpec("Updatereference", "Update Reference", "Pulse", PAGE_VACE,
            help="read the Reference TOP again and send it (it takes effect at the engine's next chunk)"),
    ParSpec("State", "State", "Str", PAGE_STATUS, "stopped", read_only=True),
    ParSpec("Fps", "FPS", "Float", PAGE_STATUS, 0.0, read_only=True),
    ParSpec("Latency", "Latency (ms)", "Float", PAGE_STATUS, 0.0, read_only=True),
    ParSpec("Dropped", "Dropped Frames", "Int", PAGE_STATUS, 0, read_only=True),
    ParSpec("Standbystate", "Standby State", "Str", PAGE_STATUS, "off", read_only=True),
    ParSpec("Message", "Message", "Str", PAGE_STATUS, "", read_only=True),
    ParSpec("Log", "Engine Log", "Str", PAGE_STATUS, "", read_only=True),
)

PAR_BY_NAME = {p.name: p for p in PARAMETERS}


def lora_scale_par(comp: Any, name: str) -> Any:
    """The scale parameter of the slot whose file has LoRA name `name` (what OSC and the engine call
    it: the file name without the extension); None when no slot holds such a file."""
    for file, scale in zip(LORA_FILE_PARS, LORA_SCALE_PARS):
        path = str(getattr(comp.par, file).eval() or "").strip()
        if path and lora_name(path) == name:
            return getattr(comp.par, scale)
    return None


def setup_parameters(comp: Any) -> None:
    """Create the custom pages and parameters on `comp` (a COMP or a Script TOP), keeping existing ones.

    Called from the Script TOP's `onSetupParameters` or once by hand on the component. Values a
    user already set are kept: only missing parameters are appended.
    """
    pages: dict[str, Any] = {}
    for spec in PARAMETERS:
        if getattr(comp.par, spec.name, None) is not None:
            continue
        if spec.page not in pages:
            pages[spec.page] = next((p for p in comp.customPages if p.name == spec.page), None) \
                or comp.appendCustomPage(spec.page)
        page = pages[spec.page]
        par = getattr(page, f"append{spec.kind}")(spec.name, label=spec.label)[0]
        if spec.menu:
            par.menuNames = list(spec.menu)
            par.menuLabels = list(spec.menu)
        if spec.min is not None:
            par.min = par.normMin = spec.min
            par.clampMin = True
        if spec.max is not None:
            par.max = par.normMax = spec.max
            par.clampMax = True
        if spec.default is not None:
            par.default = spec.default
            par.val = spec.default
        if spec.help:
            try:
                par.help = spec.help
            except Exception:  # noqa: BLE001 - read-only or missing on some builds (td.tdError, AttributeError)
                pass
        par.readOnly = spec.read_only
