"""The Loom TouchDesigner extension: one object per Loom component that owns the bridge to the engine.

`build_loom.py` creates the component (run once in the Textport): a Text DAT `loom_ext` that
imports this class, the component's Extension `op('./loom_ext').module.LoomExt(me)` promoted, the
Script TOP `loom_top` whose callbacks (`script_top_callbacks.py`) call `Cook`, a Parameter Execute
DAT (`parexec_callbacks.py`) watching the control parameters only, and an Execute DAT
(`execute_callbacks.py`) that forces a cook in each frame nothing else cooked it while the engine
runs: TouchDesigner cooks a node only when something needs it, and the engine's frame for input N arrives after
cook N, so without it a still input or an unwatched output would never show new engine frames.
A Switch TOP shows the input while the component is inactive, so an inactive Loom costs nothing.

Frames in: `TOP.cudaMemory()` when the transport is cuda-ipc (device to device, no CPU copy),
`TOP.numpyArray(delayed=True)` otherwise (the download of the last cook, so the GPU is never
stalled), and for any texture `cudaMemory` refuses (16-bit float); on shm and tcp its conversion
to the engine's format runs on a feeder thread (`host_feeder.py`), not in the cook. The CUDAMemory object owns
TouchDesigner's copy of the texture and frees it when dropped, and the texture is reused after the
cook, so `Cook` holds the object until the bridge has finished copying out of it, inside the cook.
All CUDA work on TouchDesigner's memory happens here, on its main thread, on one CUDA stream per
component, passed to `cudaMemory`, to the bridge's device copies and to `copyCUDAMemory`. Frames
out: the newest engine frame (or the fallback) through `copyCUDAMemory` in the input's layout, or
`copyNumpyArray` as uint8 RGB bottom-up (the channel order the Script TOP documents). Nothing here
blocks the cook on the engine: a slow or dead engine shows the fallback and a status on the
read-only parameters.

VACE (the Control page, for *vace* model presets): the Script TOP's second input is the control video,
sent beside each input frame in the same slot (on cuda-ipc device to device too); Control Scale and
Control Source are live parameters; the Reference TOP's picture is read when it is set, at Update
Reference and when an engine starts, and sent as the reference image (in effect at the engine's next
chunk). They go to an engine only once it reports control blocks (its first stats say so): a model
without them would refuse them. The default (embedded) model reads its input's edges: Control Scale is
their scale (0: the input's structure not given), Control Source must stay edges, and the second input
and the Reference TOP are not used (its stats say `edges_only`).

LoRAs: the LoRA page's files go to a launched engine as `--lora PATH:SCALE`, its scales as the
`lora_scales` live parameter. A file the host can see is wrong (missing, a name another slot has) is
left out with a message; one the engine refuses (a LoRA for another model size) is named in the
engine's failure, so the component starts the engine again without it and says so: either way the
stream goes on with the other LoRAs.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from loom_live.host_bridge.wire.params import CONTROL_PARAMS, steps_for
from loom_live.plugin.touchdesigner.parameters import LORA_FILE_PARS, LORA_SCALE_PARS, PARAMETERS

if TYPE_CHECKING:
    import numpy as np

LOG_TAIL_LINES = 6
SCRIPT_TOP = "loom_top"  # the component's Script TOP (build_loom.py names it)
STATUS_PARS = tuple(p.name for p in PARAMETERS if p.read_only)  # written by the cook, never by a user
# What the Parameter Execute DAT watches: written each cook, the status parameters would fire it every cook
PAREXEC_PARS = " ".join(p.name for p in PARAMETERS if not p.read_only)
PROMPT_PARS = ("Prompt", "Transition")  # the Loom page parameters that make one prompt message
PARAM_PARS = ("Steps", "Noisescale", "Motionaware")  # ... and one params message
CONTROL_PARS = ("Controlscale", "Controlsource")  # VACE: one params message, once the engine has control blocks
CONTROL_NAMES = tuple(p.name for p in CONTROL_PARAMS)  # their live-parameter names, kept out of a hand-over
REFERENCE_PAR = "Referencetop"
ENGINE_PARS = ("Transport", "Config", "Enginepython", "Endpoint", "Secretfile", "Fallback", "Passthrough",
               "Hotstandby")
LORA_GROUP = "Lora"  # the key of a refused lora_scales update in `refused`
SCALE_OF = dict(zip(LORA_FILE_PARS, LORA_SCALE_PARS))  # a LoRA slot's file parameter -> its scale parameter
DEVICE_CHANNELS = (1, 3, 4)  # channel counts the bridge takes from device memory (formats.DTYPE_NAMES: dtypes)
# import name -> what to install for it: the host-side dependencies the bridge imports (host_bridge/__init__.py)
DISTRIBUTIONS = {"zmq": "pyzmq", "numpy": "numpy"}

log = logging.getLogger(__name__)


class LoomExt:
    """Promoted methods (capitalised) are callable as `op('loom').Start()` etc."""

    def __init__(self, ownerComp: Any) -> None:
        self.ownerComp = ownerComp
        self.bridge: Any = None
        self.cooks = 0
        self.cuda_submits = 0
        self.numpy_submits = 0
        self.last_error = ""
        self.note = ""  # a lasting remark from Start (a transport fallback), shown with the status
        self.device_output: Any = None
        self._streams_shared: bool | None = None  # whether this TD build's CUDA calls take our stream (None: unseen)
        self.input_note = ""  # about this cook's input (a format that goes through the CPU, a refused frame)
        self.refused: dict[str, str] = {}  # Loom page values the engine cannot take, by group; shown until fixed
        self.closers: list[threading.Thread] = []  # stopping engines (Stop does not wait for them)
        self.last_wanted: Any = None  # what the stopped bridge had been asked for, handed to the next one
        self._host_output: np.ndarray | None = None  # the shm/tcp output in TD's row order, reused
        self._host_output_of: np.ndarray | None = None  # the engine frame it holds
        self._asked_last_frame = False  # something other than OnFrameStart cooked the Script TOP
        self._forcing = False
        self.feeder: Any = None  # shm/tcp: converts and submits input frames off the main thread
        self._downloading = False  # a delayed numpyArray() download is under way (later Nones mean no image)
        self.loras: dict[str, Any] = {}  # the LoRAs the running engine was started with, by slot (file parameter)
        self.engine_refused: dict[str, str] = {}  # LoRA path -> the engine's words; left out until the next Start
        self.vace: bool | None = None  # whether the running engine has VACE control blocks (None: not known yet)
        self.oversize_dropped = 0  # cuda-ipc input frames over max_frame_side, dropped here (shown in Dropped)
        self._oversize: tuple[int, int] | None = None  # the size of the input refused last cook, if any

    # --- engine lifetime ---------------------------------------------------------------------

    def Start(self) -> None:
        """Start (or restart) the bridge with the current Engine and LoRA page settings; a LoRA an earlier
        engine refused is tried again (the model may have changed with them)."""
        self.engine_refused.clear()
        self._start()

    def _start(self) -> None:
        self.Stop()
        par = self.ownerComp.par
        missing = missing_dependency()
        if missing:
            self._error(missing)
            return
        from loom_live.host_bridge import Bridge, BridgeConfig

        endpoint = str(par.Endpoint.eval() or "").strip() or None
        python = str(par.Enginepython.eval() or "").strip()
        if endpoint is None and not python:
            self._error("set 'Engine Python' to the python executable of the environment that has torch")
            return
        secret_file = str(par.Secretfile.eval() or "").strip() or None
        if endpoint is not None:
            from loom_live.host_bridge.reach import check_reachable
            from loom_live.host_bridge.wire.errors import UserError

            try:  # a peer that will never let this host in is said now, not after a silent wait
                check_reachable(endpoint, secret_file, names=("Remote Endpoint", "Secret File"))
            except UserError as exc:
                self._error(str(exc))
                return
        transport, note = str(par.Transport.eval()), ""
        if transport == "cuda-ipc":
            from loom_live.host_bridge.wire.rings.cuda import cuda_available

            ok, why = cuda_available()
            if not ok:  # e.g. macOS, no NVIDIA GPU, or cuda-python missing from TD's module path
                transport, note = "shm", f"cuda-ipc unavailable ({why}); using shm"
        standby = bool(par.Hotstandby.eval())
        if standby and endpoint is not None:  # the served engine is not started here: no second one to keep
            standby = False
            note = "; ".join(filter(None, (note, "Hot Standby is for a local engine: off with Remote Endpoint")))
        from loom_live.host_bridge import loras

        self.loras = self._lora_choices(launch=endpoint is None)
        try:
            cfg = BridgeConfig(transport=transport, launch=endpoint is None, engine_python=python,
                               engine_config=str(par.Config.eval() or "default"), endpoint=endpoint,
                               secret_file=secret_file if endpoint is not None else None,
                               fallback=str(par.Fallback.eval()), passthrough=bool(par.Passthrough.eval()),
                               standby=standby,
                               engine_args=loras.engine_args(self.loras.values()))
            self.bridge = Bridge(cfg)
            self.bridge.start()
        except Exception as exc:  # a bad setting must show on the component, never break the network
            self.bridge = None
            self._error(f"cannot start the engine: {exc}")
            return
        self.note = note
        self.vace = None
        self._downloading = False
        self.oversize_dropped, self._oversize = 0, None  # Dropped counts this bridge's frames
        if transport != "cuda-ipc":  # on cuda-ipc a host frame is staged on the device: that stays in the cook
            from loom_live.plugin.touchdesigner.host_feeder import HostFeeder

            self.feeder = HostFeeder(self.bridge)
        self._hand_over(self.last_wanted)  # a page value refused below keeps the last good one
        for group in (PROMPT_PARS, PARAM_PARS):  # the bridge tells each engine it starts what the page says
            self._record_controls(group)
        self._record_lora_scales()
        par.State = "starting"

    def Stop(self) -> None:
        """Stop the engine without waiting for it: closing waits seconds for the process to exit, and
        this runs on TouchDesigner's main thread (a parameter callback), where every cook would wait."""
        if self.bridge is not None:
            bridge, self.bridge = self.bridge, None
            feeder, self.feeder = self.feeder, None
            self.last_wanted = bridge.wanted
            # not a daemon: should TD quit meanwhile, its Python waits for the engine to be stopped
            closer = threading.Thread(target=self._close, args=(bridge, feeder), name="loom-close")
            closer.start()
            self.closers = [t for t in self.closers if t.is_alive()] + [closer]
        if self.device_output is not None:
            self.device_output.close()
            self.device_output = None
        par = self.ownerComp.par  # the engine's last status is not a stopped component's: its notes stay
        par.State, par.Fps, par.Latency, par.Message = "stopped", 0.0, 0.0, self._message()
        par.Standbystate = "off"

    def WaitClosed(self, timeout_s: float = 10.0) -> bool:
        """Wait until every engine this extension stopped is gone (scripts, tests); True when they are."""
        deadline = time.monotonic() + timeout_s
        for closer in list(self.closers):
            closer.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.closers)

    def _close(self, bridge: Any, feeder: Any = None) -> None:
        try:
            if feeder is not None:
                feeder.close()
            bridge.close()
        except Exception as exc:  # closing must always leave the component usable
            self.last_error = str(exc)

    # --- TouchDesigner's extension lifecycle -------------------------------------------------

    def onInitTD(self) -> None:
        """TD calls this once the extension is attached (at project open, after a re-init): an Active
        component starts its engine, so an edit of the extension's DAT does not end the show."""
        active = getattr(self.ownerComp.par, "Active", None)
        if active is not None and active.eval():
            self.Start()

    def onDestroyTD(self) -> None:
        """TD calls this on the old object before re-creating the extension (DAT edited, Re-Init
        Extensions): its engine goes with it, or it would keep running beside the new one's."""
        self.Stop()

    def __delTD__(self) -> None:
        """What builds that know no `onDestroyTD` call on re-initialisation: the same clean-up."""
        self.Stop()

    def OnFrameStart(self) -> None:
        """The Execute DAT's onFrameStart: while the engine runs, a frame in which nothing else cooked
        the Script TOP is followed by a forced cook, so engine frames show even when the input is still
        or nothing downstream asks for the output. Where something does ask every frame, nothing is
        forced: a forced cook on top of it would submit each input twice."""
        if self.bridge is None:
            return
        asked, self._asked_last_frame = self._asked_last_frame, False
        script = self.ownerComp.op(SCRIPT_TOP)
        if asked or script is None:
            return
        self._forcing = True
        try:
            script.cook(force=True)
        finally:
            self._forcing = False

    # --- parameters --------------------------------------------------------------------------

    def OnParValueChange(self, par: Any, prev: Any = None) -> None:
        name = par.name
        if name in STATUS_PARS:  # the cook's own writes, should the DAT watch them
            return
        if name == "Active":
            self.Start() if par.eval() else self.Stop()
        elif name in ENGINE_PARS and self.ownerComp.par.Active.eval():
            self.Start()  # also after a start that failed for want of this very setting
        elif name in LORA_FILE_PARS and self.ownerComp.par.Active.eval():
            self._start()  # the model is the same: a LoRA it refused stays out (Start tries it again)
        elif self.bridge is None:
            return
        elif name in PROMPT_PARS + PARAM_PARS:
            self._record_controls(PROMPT_PARS if name in PROMPT_PARS else PARAM_PARS)
        elif name in LORA_SCALE_PARS:
            self._record_lora_scales()
        elif name in CONTROL_PARS:
            self._record_vace()
        elif name == REFERENCE_PAR:
            self._send_reference()

    def OnPulse(self, par: Any) -> None:
        if par.name == "Start":
            self.Start()
        elif par.name == "Stop":
            self.Stop()
        elif par.name == "Updatereference" and self.bridge is not None:
            self._send_reference()

    def _hand_over(self, wanted: Any) -> None:
        """Ask the new bridge for what the last one was asked for (values it already took). Not the LoRA
        scales: the new engine may load other LoRAs, and a fresh engine is told all parameters in one
        message, which a scale for a LoRA it lacks would get refused whole; the LoRA page says them."""
        if wanted is None:
            return
        if wanted.prompt is not None:
            self.bridge.set_prompt(wanted.prompt.text, transition_chunks=wanted.prompt.transition_chunks)
        params = {k: v for k, v in wanted.params.items() if k != "lora_scales" and k not in CONTROL_NAMES}
        if params:
            self.bridge.set_params(**params)

    def _lora_choices(self, launch: bool) -> dict[str, Any]:
        """The LoRA page's files to load, by slot; a slot that cannot be loaded gets a message and is left out."""
        from loom_live.host_bridge.loras import lora_choice

        par, chosen = self.ownerComp.par, {}
        for slot, file in enumerate(LORA_FILE_PARS, 1):
            self.refused.pop(file, None)
            path = str(getattr(par, file).eval() or "").strip()
            if not path:
                continue
            if not launch:
                self.refused[file] = (f"LoRA {slot} not loaded: LoRA files load with a launched engine; a remote "
                                      "engine has the LoRAs it was served with (loom serve --lora)")
                continue
            try:
                choice = lora_choice(path, float(getattr(par, SCALE_OF[file]).eval()))
            except ValueError as exc:
                self.refused[file] = f"LoRA {slot} not loaded: {exc}"
                continue
            taken = next((LORA_FILE_PARS.index(f) + 1 for f, c in chosen.items() if c.name == choice.name), None)
            if choice.path in self.engine_refused:
                self.refused[file] = f"LoRA {slot} not loaded, the engine refused it: " + \
                    self.engine_refused[choice.path]
            elif taken is not None:
                self.refused[file] = (f"LoRA {slot} not loaded: LoRA {taken} has a file named {choice.name!r} too "
                                      "(the name live scales address); rename one")
            else:
                chosen[file] = choice
        return chosen

    def _record_lora_scales(self) -> None:
        """Give the bridge the LoRA page's scales of the loaded LoRAs, by name, as one `lora_scales` update."""
        if not self.loras:
            return
        par = self.ownerComp.par
        try:
            self.bridge.set_params(lora_scales={c.name: float(getattr(par, SCALE_OF[file]).eval())
                                                for file, c in self.loras.items()})
        except ValueError as exc:
            self.refused[LORA_GROUP] = f"LoRA scales refused ({exc}); keeping the last good values"
        else:
            self.refused.pop(LORA_GROUP, None)
        par.Message = self._message()

    def _leave_out_refused_lora(self) -> None:
        """An engine that failed naming one of its LoRA files (for another model, unreadable) is started
        again without it: the stream goes on with the others, and the component says which was refused."""
        from loom_live.host_bridge.loras import refused_lora

        stats = self.bridge.stats()
        found = refused_lora(f"{stats.get('last_error') or ''}\n{stats.get('message') or ''}", self.loras.values())
        if found is None:
            return
        choice, words = found
        self.engine_refused[choice.path] = words
        self._start()

    def _record_controls(self, group: tuple[str, ...]) -> None:
        """Give the bridge the Loom page's prompt or parameter values; it tells the engine now or when one runs.

        A value the engine cannot take (an empty prompt, steps 7 sent over OSC) is refused here with a
        message on the component, and the last good value stays: a refusal must never reach the cook.
        """
        par = self.ownerComp.par
        try:
            if group == PROMPT_PARS:
                self.bridge.set_prompt(str(par.Prompt.eval()), transition_chunks=int(par.Transition.eval()))
            else:  # the bridge checks the values against the live-parameter schema
                self.bridge.set_params(steps=steps_for(int(par.Steps.eval())), noise_scale=float(par.Noisescale.eval()),
                                       motion_aware=bool(par.Motionaware.eval()))
        except ValueError as exc:
            self.refused[group[0]] = f"{'/'.join(group)} refused ({exc}); keeping the last good value"
        else:
            self.refused.pop(group[0], None)
        par.Message = self._message()

    def _learn_vace(self) -> None:
        """Once the engine's first report is in: a VACE engine is told the Control page (scale, source,
        reference); for another, a wired control input or a Reference TOP is said to be unused."""
        session = self.bridge.engine_report().get("session")
        if not session:
            return
        self.vace = "control" in session
        if self.vace and session["control"].get("edges_only"):
            self.note = "; ".join(m for m in (self.note, "the model reads its input's edges: Control Scale is their "
                                              "scale; the control input and the Reference TOP are not used") if m)
            self._record_vace()
        elif self.vace:
            self._record_vace()
            self._send_reference(only_set=True)  # an empty Reference TOP leaves the config's own reference
        else:
            self.note = "; ".join(m for m in (self.note, "the model has no VACE control blocks: the control input "
                                              "and the Control page are not used") if m)

    def _record_vace(self) -> None:
        """Control Scale and Control Source to a VACE engine (the schema's ranges and choices, as for the Loom page)."""
        if not self.vace:
            return
        par = self.ownerComp.par
        try:
            self.bridge.set_params(context_scale=float(par.Controlscale.eval()),
                                   control_source=str(par.Controlsource.eval()))
        except ValueError as exc:
            self.refused[CONTROL_PARS[0]] = f"Control Scale/Control Source refused ({exc}); keeping the last good value"
        else:
            self.refused.pop(CONTROL_PARS[0], None)
        par.Message = self._message()

    def _send_reference(self, only_set: bool = False) -> None:
        """The Reference TOP's picture (read now: a one-off download) as the reference image; none when
        emptied (`only_set`: nothing then)."""
        top = getattr(self.ownerComp.par, REFERENCE_PAR).eval() if self.vace else None
        if not self.vace or only_set and not top:
            return
        try:
            image = top.numpyArray() if top else None
            if top and image is None:
                raise ValueError("the Reference TOP has no image")
            self.bridge.set_reference(image, layout="touchdesigner")
        except Exception as exc:  # a parameter callback must leave the component working
            self.refused[REFERENCE_PAR] = f"Reference TOP not sent ({exc}); the reference stays"
        else:
            self.refused.pop(REFERENCE_PAR, None)
        self.ownerComp.par.Message = self._message()

    def _message(self, status_message: str = "") -> str:
        return "; ".join(m for m in (self.note, self.input_note, *self.refused.values(), status_message) if m)

    # --- the cook ----------------------------------------------------------------------------

    def Cook(self, scriptOp: Any) -> None:
        """Submit the input TOP, write the newest output into `scriptOp`; called from onCook.

        Never raises: an input the bridge cannot take this cook (a TOP with no image, a pixel format
        it does not know) is said on the component and the stream goes on with the next cook."""
        self.cooks += 1
        self._asked_last_frame = self._asked_last_frame or not self._forcing
        if self.bridge is None:  # inactive: the component's Switch TOP shows the input, nothing to copy
            return
        top = scriptOp.inputs[0] if scriptOp.inputs else None
        if top is None:
            return
        self.input_note = ""
        control = scriptOp.inputs[1] if len(scriptOp.inputs) > 1 else None  # VACE: the control video
        if self.vace is None:
            self._learn_vace()
        try:
            status = self._cook_cuda(scriptOp, top, control) if self._use_cuda() else None
            if status is None:
                status = self._cook_numpy(scriptOp, top, control)
        except Exception as exc:  # a raising cook freezes the output for the rest of the show
            self.input_note = f"input frame not taken: {exc}"
            status = self.bridge.status()
        self._publish(status)
        if self.loras and self.bridge.status().state in ("restarting", "dead"):  # only a failed engine refuses one
            self._leave_out_refused_lora()

    def _cook_numpy(self, scriptOp: Any, top: Any, control_top: Any = None) -> Any:
        """Through host memory: the last cook's download of the input (and of the control input, the same
        cook's) in, the newest output out as uint8 RGB bottom-up (3 channels: no alpha, no order to swap)."""
        frame = top.numpyArray(delayed=True)  # None on the first call: nothing downloaded yet
        control = control_top.numpyArray(delayed=True) if control_top is not None else None
        if frame is None and self._downloading:
            self.input_note = "the input TOP has no image this cook"
        self._downloading = True
        if frame is not None:
            if self.feeder is not None:
                self.feeder.offer(frame, control)  # converted and submitted on the feeder thread
                self.input_note = self.input_note or self.feeder.error
            else:  # cuda-ipc (no float conversion: the frame is staged on the device as it is)
                self.bridge.submit(frame, layout="touchdesigner", control=control)
            self.numpy_submits += 1
        out, status = self.bridge.latest()
        if out is not None:
            scriptOp.copyNumpyArray(self._bottom_up(out))
        elif frame is not None:
            scriptOp.copyNumpyArray(frame)
        return status

    def _bottom_up(self, rgb: np.ndarray) -> np.ndarray:
        """The engine's top-down frame in TouchDesigner's row order, in a buffer reused across cooks."""
        import numpy as np  # imported by the running bridge already; the module loads without it

        buf = self._host_output
        if buf is not None and self._host_output_of is rgb:
            return buf  # no new engine frame since the last cook: the flipped copy stands
        if buf is None or buf.shape != rgb.shape:
            buf = self._host_output = np.empty_like(rgb)
        np.copyto(buf, rgb[::-1])
        self._host_output_of = rgb  # the bridge hands out each frame as one read-only array
        return buf

    def _cook_cuda(self, scriptOp: Any, top: Any, control_top: Any = None) -> Any:
        """Device to device both ways: TOP -> bridge staging slot, newest output -> our buffer -> TOP; the
        control input's texture (VACE) into the staging beside the input's, on the same stream.

        Returns None, having taken nothing, for a texture format the bridge does not take on the device
        (16-bit float, 2 channels): that cook goes through host memory instead."""
        import numpy as np

        from loom_live.host_bridge.newest_frames import DeviceFrame
        from loom_live.host_bridge.wire.pixels import DTYPE_NAMES

        if self.device_output is None:
            self.device_output = DeviceBuffer()
        stream = self.device_output.stream
        try:
            memory = self._on_stream(top.cudaMemory, stream)  # TD's copy of the texture; freed when `memory` is dropped
        except Exception as exc:  # e.g. TD 2025 refuses 16-bit float formats: this input goes through the CPU
            self.input_note = f"the input's cudaMemory() refused ({exc}); it goes through the CPU"
            return None
        if memory is None:
            raise ValueError("the input TOP has no image this cook")
        shape = memory.shape
        dtype = np.dtype(shape.dataType)
        if dtype.name not in DTYPE_NAMES or shape.numComps not in DEVICE_CHANNELS:
            self.input_note = (f"{shape.numComps}-channel {dtype.name} input goes through the CPU; device to "
                               f"device takes {', '.join(DTYPE_NAMES)} with 1, 3 or 4 channels")
            return None
        if max(shape.width, shape.height) > self.bridge.config.max_frame_side:
            return self._drop_oversize(shape.width, shape.height)
        self._oversize = None
        pitch = shape.width * shape.numComps * dtype.itemsize
        control_memory = self._control_memory(control_top, stream)
        control = None
        if control_memory is not None:
            c = control_memory.shape
            c_dtype = np.dtype(c.dataType)
            control = DeviceFrame(control_memory.ptr, c.width * c.numComps * c_dtype.itemsize, c.width, c.height,
                                  c.numComps, c_dtype.name)  # one that does not match is refused by the bridge
        # where TD's calls share our stream the copies are only queued (the main thread does not wait for the
        # GPU's turn), and the bridge holds TD's CUDAMemory objects until the GPU has copied them
        queue = self.queues_copies
        self.bridge.submit_cuda(memory.ptr, pitch, shape.width, shape.height, shape.numComps, dtype.name,
                                layout="touchdesigner", stream=stream, control=control,
                                keep=(memory, control_memory) if queue else None)
        self.cuda_submits += 1
        nbytes = pitch * shape.height
        ptr = self.device_output.ensure(nbytes)
        # output comes back in the input's layout and size, copied here and then into the TOP, in that order
        status = self.bridge.latest_cuda(ptr, pitch, stream=stream, wait=not queue)
        self._on_stream(scriptOp.copyCUDAMemory, stream, ptr, nbytes, shape)
        if self._streams_shared is None:  # this build's calls took the stream: later cooks queue
            self._streams_shared = True
        return status

    def _drop_oversize(self, width: int, height: int) -> Any:
        """An input larger than the bridge takes from device memory (submit_cuda would refuse it): each cook's
        frame is dropped and counted, the status says so while the size stays, and it is logged once per size,
        not every cook."""
        limit = self.bridge.config.max_frame_side
        self.input_note = (f"the input is {width}x{height}: cuda-ipc takes at most {limit} px per side "
                           "(max_frame_side); its frames are dropped until it is smaller")
        self.oversize_dropped += 1
        if self._oversize != (width, height):
            self._oversize = (width, height)
            log.warning("%s", self.input_note)
        return self.bridge.status()

    def _control_memory(self, control_top: Any, stream: int) -> Any:
        """The control input's CUDAMemory, or None (not wired, no image, a format cudaMemory refuses: said)."""
        if control_top is None:
            return None
        try:
            memory = self._on_stream(control_top.cudaMemory, stream)
        except Exception as exc:
            self.input_note = f"the control input's cudaMemory() refused ({exc}); this frame goes without it"
            return None
        if memory is None:
            self.input_note = "the control input TOP has no image this cook; this frame goes without it"
        return memory

    @property
    def queues_copies(self) -> bool:
        """Whether the cuda-ipc cooks only queue their device copies (this build's calls share our stream)."""
        return self._streams_shared is True

    def _on_stream(self, method: Any, stream: int, *args: Any) -> Any:
        """Call a TD method with `stream=`. A build whose method takes no stream gets the call without it: its
        copy runs on the default stream, which our stream does not wait for, so from then on the bridge's
        copies are waited for in the cook (`_streams_shared` false) instead of only queued."""
        try:
            return method(*args, stream=stream)
        except TypeError as exc:
            if "stream" not in str(exc):
                raise
            if self._streams_shared is not False:
                log.warning("this TouchDesigner build's %s takes no CUDA stream: each cook waits for its GPU copies "
                            "(a build whose calls take one only queues them)", getattr(method, "__name__", method))
            self._streams_shared = False
            return method(*args)

    def _use_cuda(self) -> bool:
        return self.bridge.config.transport == "cuda-ipc"

    def _publish(self, status: Any) -> None:
        """Write the status parameters that changed (each write is work for TD and for what watches it)."""
        tail = status.log_tail or ""
        if isinstance(tail, (list, tuple)):
            tail = "\n".join(tail)
        values = {"State": str(getattr(status.state, "value", status.state)),
                  "Fps": round(float(status.fps or 0.0), 2),
                  "Latency": round(float(status.latency_ms or 0.0), 1),
                  "Dropped": int(status.dropped or 0) + self.oversize_dropped,
                  "Standbystate": status.standby or "off",
                  "Message": self._message(status.message),
                  "Log": "\n".join(str(tail).splitlines()[-LOG_TAIL_LINES:])}
        par = self.ownerComp.par
        for name, value in values.items():
            if getattr(par, name).eval() != value:
                setattr(par, name, value)

    def _error(self, text: str) -> None:
        self.last_error = text
        self.ownerComp.par.State = "error"
        self.ownerComp.par.Message = text


def missing_dependency() -> str:
    """What TouchDesigner's Python must be given before the bridge can run, or "" when nothing is missing.

    The component and its parameters load without pyzmq or numpy (they need only the live-parameter schema),
    so a Python that lacks one is said on the component when the engine starts, not as a Textport traceback."""
    try:
        import loom_live.host_bridge.client  # noqa: F401 (the module that imports numpy and pyzmq)
    except ImportError as exc:
        name = (exc.name or "").partition(".")[0]
        dist = DISTRIBUTIONS.get(name, name)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return (f"TouchDesigner's Python lacks {dist!r} ({exc}), which the Loom bridge needs: install it with a "
                f"Python {version} into a folder of its own (python{version} -m pip install --target FOLDER {dist}; "
                f"Windows: py -{version} -m pip ...) and add that folder to TouchDesigner's Python 64-bit Module Path "
                "(Preferences > General), then restart TouchDesigner; see plugin/touchdesigner/README.md")
    return ""


class DeviceBuffer:
    """The component's CUDA stream, and one cudaMalloc'd buffer the engine's output is copied into.

    The docs warn that the default stream "results in poor performance": every device call of a
    cook goes on this one non-blocking stream, in order. `scriptTOP.copyCUDAMemory` copies from the
    buffer into the TOP during the cook, so the buffer must outlive the cook; it is reallocated
    only when the frame size changes.
    """

    def __init__(self) -> None:
        from loom_live.host_bridge.wire.rings.cuda import check, cudart

        if cudart is None:
            raise RuntimeError("the cuda-ipc transport needs cuda-python in TouchDesigner's Python")
        self._check, self._cudart = check, cudart
        self.ptr = 0
        self.nbytes = 0
        self._stream = check(cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking), "cudaStreamCreate")
        self.stream = int(self._stream)  # the handle as TouchDesigner's methods take it

    def ensure(self, nbytes: int) -> int:
        """The buffer for `nbytes`; a new size frees the old buffer but keeps the stream, whose handle
        TouchDesigner's calls of this cook already hold (a destroyed stream crashes the driver)."""
        if nbytes != self.nbytes:
            self._free_buffer()
            self.ptr = int(self._check(self._cudart.cudaMalloc(nbytes), "cudaMalloc"))
            self.nbytes = nbytes
        return self.ptr

    def _free_buffer(self) -> None:
        if self._stream is not None:
            self._check(self._cudart.cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")
        if self.ptr:
            self._check(self._cudart.cudaFree(self.ptr), "cudaFree")
            self.ptr, self.nbytes = 0, 0

    def close(self) -> None:
        self._free_buffer()
        if self._stream is not None:
            self._check(self._cudart.cudaStreamDestroy(self._stream), "cudaStreamDestroy")
            self._stream = None
