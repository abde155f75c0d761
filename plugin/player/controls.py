"""Live control of a running player: one command vocabulary for the keyboard and for OSC.

Keys in the window and OSC messages both turn into `Command`s on one thread-safe queue; the
frame loop drains the queue between frames and applies each command to the engine. So the OSC
server's thread never touches the bridge, and a burst of messages (a fader sweep) cannot stall
the frame loop: only the newest value of each setting is sent to the engine per frame. The bridge
remembers what was set and tells an engine that starts or restarts later; ranges, defaults and
step lists are the live-parameter schema's (host_bridge/wire/params.py).
"""

from __future__ import annotations

import math
import queue
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom_live.host_bridge.wire.params import (
    ADAPTER_STRENGTH,
    CONTEXT_SCALE,
    CONTROL,
    CONTROL_SOURCES,
    LIVE,
    LORA_SCALES,
    MOTION_AWARE,
    NOISE_SCALE,
    STEP_LISTS,
    STEPS,
    TRANSITION_CHUNKS,
    LiveParam,
    check_prompt_request,
    family_params,
    steps_for,
)

NOISE_SCALE_KEY_STEP = NOISE_SCALE.ui_step
LORA_KEY_STEP = LORA_SCALES.ui_step
CONTEXT_SCALE_KEY_STEP = CONTEXT_SCALE.ui_step
ADAPTER_STRENGTH_KEY_STEP = ADAPTER_STRENGTH.ui_step
# Prompts sent live (typed, OSC, the web page) kept beside the run's own list: n/b and the page step through them.
MAX_LIVE_PROMPTS = 32
NO_VACE = ("the model has no VACE control blocks and reads no edges (use the default preset for its edge "
           "scale, -c wan2.1-vace-1.3b, or tiny-vace on a CPU)")
EDGES_ONLY = ("the model reads its input's edges only, scaled by the control scale; other sources and a "
              "reference need a *vace* preset (-c wan2.1-vace-1.3b, or tiny-vace on a CPU)")
# The live parameter each command sets: one the running engine does not take is refused here, not sent to it.
SETS_PARAM = {"steps": STEPS.name, "noise_scale": NOISE_SCALE.name, "noise_step": NOISE_SCALE.name,
              "motion_aware": MOTION_AWARE.name, "lora_scale": LORA_SCALES.name, "lora_step": LORA_SCALES.name,
              "transition_chunks": TRANSITION_CHUNKS.name, "context_scale": CONTEXT_SCALE.name,
              "context_step": CONTEXT_SCALE.name, "control_source": CONTROL.name, "control_next": CONTROL.name,
              "adapter_strength": ADAPTER_STRENGTH.name, "adapter_step": ADAPTER_STRENGTH.name}
# The live parameters the state holds, under their own names, each as the state keeps an engine's value (steps: how
# many); transition_chunks is not among them: the state's None is "the engine's own".
HELD: dict[str, Callable[[Any], Any]] = {STEPS.name: len, NOISE_SCALE.name: float, MOTION_AWARE.name: bool,
                                         LORA_SCALES.name: dict, CONTROL.name: str, CONTEXT_SCALE.name: float,
                                         ADAPTER_STRENGTH.name: float}


@dataclass(frozen=True)
class Command:
    """One control action: `name` from COMMANDS, with its arguments already validated.

    `refused_as`: how a refusal of it is said to whoever sent it, where not in the words the keys and the page share:
    an OSC message's refusal names the address sent (`osc.refusal`). The frame loop refuses some commands only as it
    applies them (a parameter the engine does not take, a prompt index past the list), long after the sender is gone.
    """

    name: str
    args: tuple[Any, ...] = ()
    refused_as: Callable[[str], str] | None = field(default=None, compare=False, repr=False)


COMMANDS = ("prompt", "prompt_next", "prompt_prev", "prompt_index", "steps", "noise_scale", "noise_step",
            "motion_aware", "lora_scale", "lora_step", "lora_next", "transition_chunks", "context_scale",
            "context_step", "control_source", "control_next", "reference", "reference_image", "reference_reload",
            "adapter_strength", "adapter_step", "pause", "overlay", "fullscreen", "quit",
            "refused")  # refused: (why,) a message another thread refused


class ControlError(ValueError):
    """A command with a bad argument; the message says what is allowed."""


@dataclass(frozen=True)
class UploadedReference:
    """A reference image given as pixels (the web page's upload, uint8 RGB), not as a file to read."""

    name: str
    image: Any


@dataclass
class ControlState:
    """What the performer has set; the frame loop reads it, `apply` changes it."""

    prompts: list[str]
    prompt_index: int = 0
    steps: int = len(LIVE["steps"].default)
    noise_scale: float = NOISE_SCALE.default
    motion_aware: bool = LIVE["motion_aware"].default
    transition_chunks: int | None = None
    lora_scales: dict[str, float] = field(default_factory=dict)  # the loaded LoRAs, by name
    lora_index: int = 0  # the LoRA the keys adjust
    # the sources this run can make (none: no structure control) and, with them, whether the model takes a reference
    # image (VACE, not the edges-only embedded model); a served engine's once it says them (`Controls.take_start`)
    control_sources: tuple[str, ...] = ()
    takes_reference: bool = True
    control_source: str = CONTROL.default
    context_scale: float = CONTEXT_SCALE.default
    reference: str | None = None  # the reference image file: --reference, then the last one sent live
    adapter_strength: float = ADAPTER_STRENGTH.default  # the edit family's temporal adapter
    paused: bool = False
    overlay: bool = True
    fullscreen: bool = False
    quit: bool = False
    message: str = ""
    refused: int = 0  # commands refused when applied (a source this run lacks, control without VACE)
    given_prompts: int = -1  # how many of `prompts` the run was started with (-1: all there are at start)
    # the model family (model.family): what a prompt is, said when an empty one is refused; the running engine's
    # once it has said it (`Controls.follow_engine`); None: not known yet (each family's words are said)
    family: str | None = "wan"
    # the live parameters the running engine takes, as its ready message said (`Controls.follow_engine`): a command
    # for another is refused, not sent. None: any (an engine started on this run's config, or one that does not
    # say); empty: a served engine (--endpoint) that has not said yet, whose config is not this run's
    takes: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.given_prompts < 0:
            self.given_prompts = len(self.prompts)

    def settings_line(self) -> str:
        """Steps, noise scale, motion-aware noise and the edit family's adapter strength, as the overlay shows them:
        those the engine takes; before it says (`takes` None: an engine started on this run's config), those its
        model family takes, so that a Wan run's overlay never shows the adapter, nor an edit run's the steps."""
        shown = {STEPS.name: f"steps {self.steps}", NOISE_SCALE.name: f"noise {self.noise_scale:.2f}",
                 MOTION_AWARE.name: f"motion {'on' if self.motion_aware else 'off'}",
                 ADAPTER_STRENGTH.name: f"adapter {self.adapter_strength:.2f}"}
        takes = self.takes if self.takes is not None else {p.name for p in family_params(self.family or "wan")}
        return "  ".join(text for name, text in shown.items() if name in takes)

    @property
    def prompt(self) -> str:
        return self.prompts[self.prompt_index]

    @property
    def lora(self) -> str | None:
        names = list(self.lora_scales)
        return names[self.lora_index % len(names)] if names else None


def steps_command(value: Any) -> Command:
    n = _int(value, "steps")
    try:
        steps_for(n)
    except ValueError as exc:
        raise ControlError(str(exc)) from None
    return Command("steps", (n,))


def _number_command(param: LiveParam, value: Any) -> Command:
    """The command that sets a number parameter (named as the parameter) to `value`, in the schema's range."""
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
        raise ControlError(f"{param.name}: {value!r} is not a number; expected {param.allowed()}") from None
    return Command(param.name, (_checked(param.check, x),))


def _clamped(param: LiveParam, value: float) -> float:
    """A value a key stepped to, kept in the schema's range."""
    return round(min(param.max, max(param.min, value)), 4)


def noise_scale_command(value: Any) -> Command:
    return _number_command(NOISE_SCALE, value)


def lora_scale_command(name: Any, value: Any) -> Command:
    """One LoRA's scale by name (OSC `/loom/lora/scale name f`, a page slider), refused in the words of what that
    takes, not the wire's mapping of names to scales; a name the engine lacks is refused when applied, naming its
    LoRAs."""
    takes = f"expected the name of a loaded LoRA and {LORA_SCALES.allowed_each()}"
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int too large for a float
        raise ControlError(f"lora scale: {value!r} is not a number; {takes}") from None
    scales = {str(name): x}
    if LORA_SCALES.problem(scales) is not None:
        raise ControlError(f"lora scale: {str(name)[:60]!r} {value!r} is not allowed; {takes}")
    return Command("lora_scale", next(iter(LORA_SCALES.check(scales).items())))


def context_scale_command(value: Any) -> Command:
    """How strongly the control video steers the structure (VACE), in the schema's range."""
    return _number_command(CONTEXT_SCALE, value)


def adapter_strength_command(value: Any) -> Command:
    """The edit family's temporal adapter (LLLite) output multiplier, in the schema's range; 0: no adapter."""
    return _number_command(ADAPTER_STRENGTH, value)


def control_source_command(value: Any) -> Command:
    """The control video's source by name (VACE), one of the schema's choices."""
    return Command("control_source", (_checked(CONTROL.check, str(value).strip() if isinstance(value, str)
                                                else value),))


def reference_command(path: Any = None) -> Command:
    """A new reference image file (VACE), read by the frame loop and sent at once; no path: none."""
    if path is not None and (not isinstance(path, str) or not path.strip()):
        raise ControlError(f"reference: {str(path)[:60]!r} is not allowed; expected an image file path (PNG, "
                           "JPEG, ...) or nothing to stream without a reference")
    return Command("reference", (path.strip() if path else None,))


def transition_chunks_command(value: Any) -> Command:
    """How many chunks a prompt change blends over, from now on (the engine's default too)."""
    return Command("transition_chunks", (_checked(TRANSITION_CHUNKS.check, _int(value, "transition_chunks")),))


def prompt_command(text: Any, transition_chunks: Any = None, *, family: str | None = "wan") -> Command:
    """A new prompt; a bad one is refused in the words of the model `family` (what its prompt is)."""
    chunks = None if transition_chunks is None else _int(transition_chunks, "transition_chunks")
    return Command("prompt", _checked(check_prompt_request, text, chunks, family))


def _checked(check: Callable[..., Any], *args: Any) -> Any:
    try:
        return check(*args)
    except ValueError as exc:
        raise ControlError(str(exc)) from None


def _int(value: Any, what: str) -> int:
    if isinstance(value, int):  # bool too; whole at any size (float() of a huge one overflows)
        return int(value)
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ControlError(f"{what}: {value!r} is not a number") from None
    if not math.isfinite(as_float):  # int() of it raises, and no setting takes it
        raise ControlError(f"{what}: {value!r} is not a finite number")
    if as_float != int(as_float):
        raise ControlError(f"{what}: {value!r} is not a whole number")
    return int(as_float)


def served_sources(start: Mapping[str, Any], control_frames: bool) -> tuple[str, ...] | None:
    """The control sources a run on an engine can switch between, as its ready message says them
    (`Bridge.engine_start`; None: not said), and video where the run sends a VACE engine control frames
    (`control_frames`: --control-input), as a config with control_source video has it (`LoomConfig.control_sources`)."""
    if "control_sources" not in start:
        return None
    video = control_frames and start.get("takes_reference") is True
    return tuple(s for s in CONTROL_SOURCES if s in start["control_sources"] or s == "video" and video)


def _flag(value: bool | None, current: bool) -> bool:
    """An on/off command's value (checked where it was read: OSC, the page), or None to flip it (a key)."""
    return not current if value is None else value


class Controls:
    """The command queue plus the state it drives; `apply_pending(bridge)` runs on the frame loop.

    `on_quit` is called as a quit is queued, on the thread that queues it: OSC's server thread, or the frame loop's
    own while one of its writes waits (a window key, Player._poll_window). The frame loop that applies the queue may
    be held up in a write to a stream whose receiver takes nothing, and the quit must cut that wait short
    (Player._stop_outputs)."""

    def __init__(self, state: ControlState, on_quit: Callable[[], None] | None = None) -> None:
        self.state = state
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._on_quit = on_quit

    def follow_engine(self, start: Mapping[str, Any] | None) -> bool:
        """Take the running engine's model family and the live parameters it takes, as its ready message said
        (`Bridge.engine_start`; None: not said, and any parameter is sent), for what is sent live from now on:
        an engine served elsewhere (`--endpoint`) need not run this run's config's. Frame loop only, like
        `apply_pending`; True when the family changed."""
        self.state.takes = None if start is None else frozenset(start["params"])
        family = None if start is None else start.get("family")
        if family is None or family == self.state.family:
            return False
        self.state.family = family
        return True

    def take_start(self, start: Mapping[str, Any] | None, bridge: Any, *, prompt_given: bool,
                   given: Mapping[str, Any], control_frames: bool = False) -> tuple[dict[str, Any], list[str]]:
        """A ready engine served with its own config (`--endpoint`): the state takes what it started on
        (`Bridge.engine_start`) for each setting the command line did not give, and the engine is told the live
        parameters it gave (`given`, by name) that it takes, which the state takes too (-c's model need not take
        them), so that the state shown is the engine's and no default of this run's config reaches it;
        `prompt_given`: -p. LoRAs are the engine's (`--lora` loads none into it): a scale given sets one it has.
        Its structure control too, where it says it (`served_sources`; `control_frames`: this run sends control
        frames). Frame loop only, once. Returns the settings taken that the state held otherwise (this run's
        config's), and the given parameters the engine does not take (not sent)."""
        if start is None:  # an engine that does not say: the state stays this run's config's
            return {}, []
        s, params = self.state, start["params"]
        sources = served_sources(start, control_frames)
        if sources is not None:  # an older engine does not say: the state keeps this run's config's
            s.control_sources = sources
        s.takes_reference = start.get("takes_reference", s.takes_reference)
        held = {k: v for k, v in params.items() if k not in given}
        send = {k: v for k, v in given.items() if k in params}
        unsent = [k for k in given if k not in params]
        if LORA_SCALES.name in send:
            loras, wanted = params[LORA_SCALES.name], send.pop(LORA_SCALES.name)
            scales = {k: v for k, v in wanted.items() if k in loras}
            unsent += [f"{LORA_SCALES.name} {k!r} (no such LoRA there)" for k in wanted if k not in loras]
            held[LORA_SCALES.name] = {**loras, **scales}
            if scales:
                send[LORA_SCALES.name] = scales
        taken: dict[str, Any] = {}
        if not prompt_given and s.prompts[0] != start["prompt"]:  # the first is this run's config's
            s.prompts[0] = taken["prompt"] = start["prompt"]
        for name, keep in HELD.items():
            if name in send and name not in held:  # given: -c need not have held it (another family's)
                setattr(s, name, keep(send[name]))
            elif name in held and getattr(s, name) != keep(held[name]):
                setattr(s, name, keep(held[name]))
                taken[name] = held[name]
        if send:
            bridge.set_params(**send)
        return taken, unsent

    def put(self, command: Command) -> None:
        """Queue a command; safe from any thread."""
        if command.name not in COMMANDS:
            raise ControlError(f"unknown command {command.name!r}; known: {', '.join(COMMANDS)}")
        self._queue.put(command)
        if command.name == "quit" and self._on_quit is not None:
            self._on_quit()

    def drain(self) -> list[Command]:
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def apply_pending(self, bridge: Any) -> list[str]:
        """Apply every queued command to the state; the bridge gets one update per changed setting (it
        tells the engine now, or when one runs).

        Returns what changed, one line per command, for the status display and the log.
        """
        commands = self.drain()
        changes: dict[str, Any] = {}
        done = []
        for command in commands:
            refused = self.state.refused
            if command.name == "refused":
                self._refuse(command.args[0])
            else:
                self._apply(command, changes)
            self._say_refusal_as_sent(command, refused)
            done.append(self.state.message)
        if "prompt" in changes:
            text, chunks = changes.pop("prompt")
            bridge.set_prompt(text, transition_chunks=chunks)
        if "reference" in changes:
            path, command = changes.pop("reference")
            refused = self.state.refused
            self._send_reference(bridge, path)
            self._say_refusal_as_sent(command, refused)
            done[max(i for i, sent in enumerate(commands) if sent is command)] = self.state.message  # its own line
        if changes:
            bridge.set_params(**changes)
        return done

    def _apply_lora(self, name: str, args: tuple[Any, ...], changes: dict[str, Any]) -> bool:
        s = self.state
        if not s.lora_scales:
            return self._refuse("no LoRA loaded (--lora PATH[:SCALE])")
        if name == "lora_next":
            s.lora_index = (s.lora_index + 1) % len(s.lora_scales)
            return True
        lora, value = args if name == "lora_scale" else (s.lora, s.lora_scales[s.lora] + args[0])
        if lora not in s.lora_scales:
            return self._refuse(f"no LoRA named {lora!r}; loaded: {', '.join(s.lora_scales)}")
        s.lora_index = list(s.lora_scales).index(lora)
        s.lora_scales[lora] = _clamped(LORA_SCALES, value)
        changes.setdefault("lora_scales", {})[lora] = s.lora_scales[lora]
        return True

    def _apply_control(self, name: str, args: tuple[Any, ...], changes: dict[str, Any]) -> bool:
        """The structure control's scale and source (VACE, or the embedded model's edges); refused (counted,
        said) on a model without it, or for a source this run cannot make (depth without its model, video
        without a control video, anything but edges on the embedded model)."""
        s = self.state
        if not s.control_sources:
            return self._refuse(f"{name}: {NO_VACE}")
        if name in ("context_scale", "context_step"):
            target = args[0] if name == "context_scale" else s.context_scale + args[0]
            s.context_scale = _clamped(CONTEXT_SCALE, target)
            changes["context_scale"] = s.context_scale
            return True
        if name == "control_next":
            i = s.control_sources.index(s.control_source) if s.control_source in s.control_sources else -1
            source = s.control_sources[(i + 1) % len(s.control_sources)]
        else:
            source = args[0]
        if source not in s.control_sources and not s.takes_reference:
            return self._refuse(f"control_source: {source!r}: {EDGES_ONLY}")
        if source not in s.control_sources:
            return self._refuse(f"control_source: {source!r} is not available in this run; available: "
                                f"{', '.join(s.control_sources)} (depth needs control.depth_model, video a "
                                "--control FILE or a host's control frames)")
        s.control_source = source
        changes["control_source"] = source
        return True

    def _send_reference(self, bridge: Any, path: str | UploadedReference | None) -> None:
        """Read the reference image here (the engine may run elsewhere) and hand it to the bridge; an
        uploaded one is handed over as it is (the file in `state.reference` stays the one `r` reloads)."""
        s = self.state
        if isinstance(path, UploadedReference):
            try:
                bridge.set_reference(path.image)
            except ValueError as exc:
                self._refuse(f"reference {path.name}: {exc}; the reference stays")
                return
            s.message = f"reference: {path.name} (uploaded)"
            return
        image = None
        if path is not None:
            try:
                image = read_reference_file(path)
            except ControlError as exc:
                self._refuse(f"{exc}; the reference stays")
                return
        try:
            bridge.set_reference(image)
        except ValueError as exc:
            self._refuse(f"reference: {exc}; the reference stays")
            return
        s.reference = path
        s.message = f"reference: {path or 'none'}"

    def _refuse(self, why: str) -> bool:
        self.state.message = why
        self.state.refused += 1
        return False

    def _say_refusal_as_sent(self, command: Command, refused_before: int) -> None:
        """A refusal of `command` (the count grew past `refused_before`) in its sender's words (Command.refused_as)."""
        if command.refused_as is not None and self.state.refused > refused_before:
            self.state.message = command.refused_as(self.state.message)

    def _refuse_untaken(self, param: str) -> None:
        takes = self.state.takes
        if not takes:
            self._refuse(f"{param}: not sent: the served engine has not said yet which settings it takes; set it "
                         "again once it runs")
            return
        if param in (CONTROL.name, CONTEXT_SCALE.name):  # what a model without structure control is, and what has it
            self._refuse(f"{param}: {NO_VACE}")
            return
        family = f" ({self.state.family} family)" if self.state.family else ""
        self._refuse(f"{param}: the engine's model{family} does not take it; it takes {', '.join(sorted(takes))}")

    def _apply(self, command: Command, changes: dict[str, Any]) -> None:
        s = self.state
        name, args = command.name, command.args
        param = SETS_PARAM.get(name)
        if param is not None and s.takes is not None and param not in s.takes:
            self._refuse_untaken(param)
            return
        if name == "prompt":
            text, chunks = args
            if text not in s.prompts:
                s.prompts.append(text)
                if len(s.prompts) - s.given_prompts > MAX_LIVE_PROMPTS:  # a script's stream of prompts: the
                    del s.prompts[s.given_prompts]  # oldest sent live goes, the run's own list stays whole
            s.prompt_index = s.prompts.index(text)
            changes["prompt"] = (text, chunks if chunks is not None else s.transition_chunks)
        elif name in ("prompt_next", "prompt_prev", "prompt_index"):
            if name == "prompt_index":
                index = args[0]
                if not 0 <= index < len(s.prompts):
                    self._refuse(f"prompt index {index} out of range 0..{len(s.prompts) - 1}")
                    return
            else:
                index = (s.prompt_index + (1 if name == "prompt_next" else -1)) % len(s.prompts)
            s.prompt_index = index
            changes["prompt"] = (s.prompt, s.transition_chunks)
        elif name == "steps":
            s.steps = args[0]
            changes["steps"] = steps_for(s.steps)
        elif name in ("noise_scale", "noise_step"):
            target = args[0] if name == "noise_scale" else s.noise_scale + args[0]
            s.noise_scale = _clamped(NOISE_SCALE, target)
            changes["noise_scale"] = s.noise_scale
        elif name == "motion_aware":
            s.motion_aware = _flag(args[0] if args else None, s.motion_aware)
            changes["motion_aware"] = s.motion_aware
        elif name in ("lora_scale", "lora_step", "lora_next"):
            if not self._apply_lora(name, args, changes):
                return
        elif name == "transition_chunks":
            s.transition_chunks = args[0]
            changes["transition_chunks"] = args[0]
        elif name in ("context_scale", "context_step", "control_source", "control_next"):
            if not self._apply_control(name, args, changes):
                return
        elif name in ("adapter_strength", "adapter_step"):
            target = args[0] if name == "adapter_strength" else s.adapter_strength + args[0]
            s.adapter_strength = _clamped(ADAPTER_STRENGTH, target)
            changes["adapter_strength"] = s.adapter_strength
        elif name == "reference":
            if not s.control_sources or not s.takes_reference:
                self._refuse(f"reference: {NO_VACE if not s.control_sources else EDGES_ONLY}")
                return
            changes["reference"] = (args[0], command)  # read and sent after the other changes of this frame
        elif name in ("reference_image", "reference_reload"):
            if not s.control_sources or not s.takes_reference:
                self._refuse(f"reference: {NO_VACE if not s.control_sources else EDGES_ONLY}")
                return
            if name == "reference_reload" and s.reference is None:
                self._refuse("reference: no reference file to read again (give --reference IMAGE, or send one "
                             "with OSC /loom/reference PATH)")
                return
            changes["reference"] = (args[0] if name == "reference_image" else s.reference, command)
        elif name == "pause":
            s.paused = _flag(args[0] if args else None, s.paused)
        elif name == "overlay":
            s.overlay = not s.overlay
        elif name == "fullscreen":
            s.fullscreen = not s.fullscreen
        elif name == "quit":
            s.quit = True
        s.message = _describe(command, s)


def read_reference_file(path: str) -> Any:
    """A reference image file as uint8 RGB [H, W, 3], read on the frame loop (OSC's path, the r key): a PNG or
    JPEG the bridge would refuse for its sides is refused from its header, not decoded first (a small PNG can
    inflate to gigabytes); ControlError names the file and what is allowed."""
    from loom_live.plugin.player.reference_image import check_reference, decode_image

    file = Path(path).expanduser()
    if not file.exists():  # said as such, not as a file that does not decode
        raise ControlError(f"reference: {path}: no such file")
    try:
        raw = file.read_bytes() if file.is_file() else b""  # a FIFO or a device would block or never end
    except OSError:
        raw = b""
    try:
        check_reference(raw, str(path), other_kinds=True)
    except ValueError as exc:
        raise ControlError(str(exc)) from None
    image = decode_image(raw)
    if image is None:
        raise ControlError(f"reference: {path} cannot be read as an image (PNG, JPEG, ...)")
    return image


def _describe(command: Command, s: ControlState) -> str:
    if command.name.startswith("prompt"):
        return f"prompt: {s.prompt}"
    if command.name == "steps":
        return f"steps: {s.steps} {steps_for(s.steps)}"
    if command.name in ("noise_scale", "noise_step"):
        return f"noise scale: {s.noise_scale:.2f}"
    if command.name == "motion_aware":
        return f"motion-aware noise: {'on' if s.motion_aware else 'off'}"
    if command.name.startswith("lora"):
        return f"LoRA {s.lora}: scale {s.lora_scales[s.lora]:.2f}"
    if command.name == "transition_chunks":
        return f"transition chunks: {s.transition_chunks}"
    if command.name in ("context_scale", "context_step"):
        return f"control scale: {s.context_scale:.2f}"
    if command.name in ("control_source", "control_next"):
        return f"control source: {s.control_source}"
    if command.name in ("adapter_strength", "adapter_step"):
        return f"adapter strength: {s.adapter_strength:.2f}"
    if command.name == "reference":
        return f"reference: {s.reference or 'none'} (being read)"
    if command.name == "reference_reload":
        return f"reference: {s.reference} (being read again)"
    if command.name == "reference_image":
        return f"reference: {command.args[0].name} (uploaded, being sent)"
    if command.name == "pause":
        return "paused" if s.paused else "playing"
    return command.name


# --- keyboard -------------------------------------------------------------------------------

KEY_HELP: Sequence[tuple[str, str]] = (
    ("q / Esc", "quit (the output file is finalised)"),
    ("space", "pause / resume the input"),
    ("Enter or t", "type a new prompt (Enter sends it, Esc cancels)"),
    ("n / b", "next / previous prompt of the --prompts list"),
    (" ".join(map(str, STEP_LISTS)), "number of denoising steps"),
    ("[ / ]", f"noise scale down / up by {NOISE_SCALE_KEY_STEP}"),
    ("m", "motion-aware noise on / off"),
    ("l", "select the next LoRA (--lora)"),
    (", / .", f"the selected LoRA's scale down / up by {LORA_KEY_STEP}"),
    ("- / =", f"VACE presets and the default one (its edges): control scale down / up by {CONTEXT_SCALE_KEY_STEP}"),
    ("c", "VACE presets: the next control source (edges, grey, flow, and depth or video when given)"),
    ("r", "VACE presets: read the reference image file again (--reference; overwrite it, then press r)"),
    ("; / '", f"edit presets: temporal adapter strength down / up by {ADAPTER_STRENGTH_KEY_STEP}"),
    ("h", "hide / show the status overlay"),
    ("f", "full screen on / off"),
)

KEY_ENTER = (10, 13)
KEY_ESC = 27
KEY_BACKSPACE = (8, 127)

_SIMPLE_KEYS: dict[str, Callable[[], Command]] = {
    "q": lambda: Command("quit"),
    " ": lambda: Command("pause"),
    "n": lambda: Command("prompt_next"),
    "b": lambda: Command("prompt_prev"),
    "[": lambda: Command("noise_step", (-NOISE_SCALE_KEY_STEP,)),
    "]": lambda: Command("noise_step", (NOISE_SCALE_KEY_STEP,)),
    "m": lambda: Command("motion_aware"),
    "l": lambda: Command("lora_next"),
    ",": lambda: Command("lora_step", (-LORA_KEY_STEP,)),
    ".": lambda: Command("lora_step", (LORA_KEY_STEP,)),
    "-": lambda: Command("context_step", (-CONTEXT_SCALE_KEY_STEP,)),
    "=": lambda: Command("context_step", (CONTEXT_SCALE_KEY_STEP,)),
    "c": lambda: Command("control_next"),
    "r": lambda: Command("reference_reload"),
    ";": lambda: Command("adapter_step", (-ADAPTER_STRENGTH_KEY_STEP,)),
    "'": lambda: Command("adapter_step", (ADAPTER_STRENGTH_KEY_STEP,)),
    "h": lambda: Command("overlay"),
    "f": lambda: Command("fullscreen"),
}


class KeyboardInput:
    """Turns window key codes into commands; holds the prompt being typed."""

    def __init__(self, controls: Controls) -> None:
        self.controls = controls
        self.typing: str | None = None

    def press(self, code: int) -> None:
        if code < 0:
            return
        code &= 0xFF
        if self.typing is not None:
            self._type(code)
        elif code == KEY_ESC:
            self.controls.put(Command("quit"))
        elif code in KEY_ENTER or chr(code) == "t":
            self.typing = ""
        elif chr(code).isdigit() and int(chr(code)) in STEP_LISTS:
            self.controls.put(steps_command(int(chr(code))))
        elif chr(code) in _SIMPLE_KEYS:
            self.controls.put(_SIMPLE_KEYS[chr(code)]())

    def _type(self, code: int) -> None:
        if code == KEY_ESC:
            self.typing = None
        elif code in KEY_ENTER:
            text, self.typing = self.typing, None
            if text and text.strip():
                self.controls.put(prompt_command(text, family=self.controls.state.family))
        elif code in KEY_BACKSPACE:
            self.typing = self.typing[:-1]
        elif 32 <= code < 127:
            self.typing += chr(code)
