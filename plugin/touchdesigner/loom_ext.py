"""The Loom TouchDesigner extension: one object per Loom component that owns the bridge to the engine.

Put this file in a Text DAT named `loom_ext` inside the component (or point the DAT's File
parameter at it) and set the component's Extension to `op('./loom_ext').module.LoomExt(me)` with
Promote on. The Script TOP's callbacks (`script_top_callbacks.py`) call `Cook`; a Parameter
Execute DAT (`parexec_callbacks.py`) forwards parameter changes.

Frames in: `TOP.cudaMemory()` when the transport is cuda-ipc (device to device, no CPU copy),
`TOP.numpyArray()` otherwise. The CUDAMemory object owns TouchDesigner's copy of the texture and
frees it when dropped, and the texture is reused after the cook, so `Cook` holds the object until
the bridge has finished copying out of it, inside the cook. Frames out: the newest engine frame
(or the fallback) through `copyNumpyArray`, in TouchDesigner's layout (bottom-up rows, BGRA for
uint8). Nothing here blocks the cook on the engine: a slow or dead engine shows the fallback and a
status on the read-only parameters.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from host_bridge.wire.params import steps_for

OUTPUT_CHANNELS = 4
LOG_TAIL_LINES = 6
PROMPT_PARS = ("Prompt", "Transition")  # the Loom page parameters that make one prompt message
PARAM_PARS = ("Steps", "Noisescale", "Motionaware")  # ... and one params message
DEVICE_CHANNELS = (1, 3, 4)  # channel counts the bridge takes from device memory (formats.DTYPE_NAMES: dtypes)


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
        self.input_note = ""  # about this cook's input (a format that goes through the CPU, a refused frame)
        self.refused: dict[str, str] = {}  # Loom page values the engine cannot take, by group; shown until fixed
        self.closers: list[threading.Thread] = []  # stopping engines (Stop does not wait for them)
        self.last_wanted: Any = None  # what the stopped bridge had been asked for, handed to the next one

    # --- engine lifetime ---------------------------------------------------------------------

    def Start(self) -> None:
        """Start (or restart) the bridge with the current Engine page settings."""
        self.Stop()
        par = self.ownerComp.par
        try:
            from host_bridge import Bridge, BridgeConfig
        except ImportError as exc:
            self._error(f"cannot import host_bridge ({exc}); add the Loom folder and a folder with pyzmq to "
                        "TouchDesigner's Python 64-bit Module Path (see plugin/touchdesigner/README.md)")
            return
        endpoint = str(par.Endpoint.eval() or "").strip() or None
        python = str(par.Enginepython.eval() or "").strip()
        if endpoint is None and not python:
            self._error("set 'Engine Python' to the python executable of the environment that has torch")
            return
        transport, note = str(par.Transport.eval()), ""
        if transport == "cuda-ipc":
            from host_bridge.wire.rings.cuda import cuda_available

            ok, why = cuda_available()
            if not ok:  # e.g. macOS, no NVIDIA GPU, or cuda-python missing from TD's module path
                transport, note = "shm", f"cuda-ipc unavailable ({why}); using shm"
        try:
            cfg = BridgeConfig(transport=transport, launch=endpoint is None, engine_python=python,
                               engine_config=str(par.Config.eval() or "default"), endpoint=endpoint,
                               fallback=str(par.Fallback.eval()), passthrough=bool(par.Passthrough.eval()))
            self.bridge = Bridge(cfg)
            self.bridge.start()
        except Exception as exc:  # a bad setting must show on the component, never break the network
            self.bridge = None
            self._error(f"cannot start the engine: {exc}")
            return
        self.note = note
        self._hand_over(self.last_wanted)  # a page value refused below keeps the last good one
        for group in (PROMPT_PARS, PARAM_PARS):  # the bridge tells each engine it starts what the page says
            self._record_controls(group)
        par.State = "starting"

    def Stop(self) -> None:
        """Stop the engine without waiting for it: closing waits seconds for the process to exit, and
        this runs on TouchDesigner's main thread (a parameter callback), where every cook would wait."""
        if self.bridge is not None:
            bridge, self.bridge = self.bridge, None
            self.last_wanted = bridge.wanted
            # not a daemon: should TD quit meanwhile, its Python waits for the engine to be stopped
            closer = threading.Thread(target=self._close, args=(bridge,), name="loom-close")
            closer.start()
            self.closers = [t for t in self.closers if t.is_alive()] + [closer]
        if self.device_output is not None:
            self.device_output.close()
            self.device_output = None
        self.ownerComp.par.State = "stopped"

    def WaitClosed(self, timeout_s: float = 10.0) -> bool:
        """Wait until every engine this extension stopped is gone (scripts, tests); True when they are."""
        deadline = time.monotonic() + timeout_s
        for closer in list(self.closers):
            closer.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.closers)

    def _close(self, bridge: Any) -> None:
        try:
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

    # --- parameters --------------------------------------------------------------------------

    def OnParValueChange(self, par: Any, prev: Any = None) -> None:
        name = par.name
        if name == "Active":
            self.Start() if par.eval() else self.Stop()
        elif self.bridge is None:
            return
        elif name in PROMPT_PARS + PARAM_PARS:
            self._record_controls(PROMPT_PARS if name in PROMPT_PARS else PARAM_PARS)
        elif name in ("Transport", "Config", "Enginepython", "Endpoint", "Fallback", "Passthrough") and \
                self.ownerComp.par.Active.eval():
            self.Start()

    def OnPulse(self, par: Any) -> None:
        if par.name == "Start":
            self.Start()
        elif par.name == "Stop":
            self.Stop()

    def _hand_over(self, wanted: Any) -> None:
        """Ask the new bridge for what the last one was asked for (values it already took)."""
        if wanted is None:
            return
        if wanted.prompt is not None:
            self.bridge.set_prompt(wanted.prompt.text, transition_chunks=wanted.prompt.transition_chunks)
        if wanted.params:
            self.bridge.set_params(**wanted.params)

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

    def _message(self, status_message: str = "") -> str:
        return "; ".join(m for m in (self.note, self.input_note, *self.refused.values(), status_message) if m)

    # --- the cook ----------------------------------------------------------------------------

    def Cook(self, scriptOp: Any) -> None:
        """Submit the input TOP, write the newest output into `scriptOp`; called from onCook.

        Never raises: an input the bridge cannot take this cook (a TOP with no image, a pixel format
        it does not know) is said on the component and the stream goes on with the next cook."""
        self.cooks += 1
        top = scriptOp.inputs[0] if scriptOp.inputs else None
        if top is None:
            return
        if self.bridge is None:
            frame = top.numpyArray(delayed=False)
            if frame is not None:
                scriptOp.copyNumpyArray(frame)  # inactive: pass the input through
            return
        self.input_note = ""
        try:
            status = self._cook_cuda(scriptOp, top) if self._use_cuda() else None
            if status is None:
                status = self._cook_numpy(scriptOp, top)
        except Exception as exc:  # a raising cook freezes the output for the rest of the show
            self.input_note = f"input frame not taken: {exc}"
            status = self.bridge.status()
        self._publish(status)

    def _cook_numpy(self, scriptOp: Any, top: Any) -> Any:
        """Through host memory: the input's numpyArray() in, the newest output as uint8 BGRA out."""
        from host_bridge.wire.pixels import to_touchdesigner

        frame = top.numpyArray(delayed=False)
        if frame is None:
            raise ValueError("the input TOP has no image this cook")
        self.bridge.submit(frame, layout="touchdesigner")
        self.numpy_submits += 1
        out, status = self.bridge.latest()
        scriptOp.copyNumpyArray(frame if out is None else to_touchdesigner(out, np.uint8, OUTPUT_CHANNELS))
        return status

    def _cook_cuda(self, scriptOp: Any, top: Any) -> Any:
        """Device to device both ways: TOP -> bridge staging slot, newest output -> our buffer -> TOP.

        Returns None, having taken nothing, for a texture format the bridge does not take on the device
        (16-bit float, 2 channels): that cook goes through host memory instead."""
        from host_bridge.wire.pixels import DTYPE_NAMES

        memory = top.cudaMemory()  # TD's copy of the texture; freed when `memory` is dropped
        if memory is None:
            raise ValueError("the input TOP has no image this cook")
        shape = memory.shape
        dtype = np.dtype(shape.dataType)
        if dtype.name not in DTYPE_NAMES or shape.numComps not in DEVICE_CHANNELS:
            self.input_note = (f"{shape.numComps}-channel {dtype.name} input goes through the CPU; device to "
                               f"device takes {', '.join(DTYPE_NAMES)} with 1, 3 or 4 channels")
            return None
        pitch = shape.width * shape.numComps * dtype.itemsize
        self.bridge.submit_cuda(memory.ptr, pitch, shape.width, shape.height, shape.numComps, dtype.name,
                                layout="touchdesigner")
        self.cuda_submits += 1
        del memory  # only now: submit_cuda has finished its device copy when it returns
        nbytes = pitch * shape.height
        if self.device_output is None:
            self.device_output = DeviceBuffer()
        ptr = self.device_output.ensure(nbytes)
        status = self.bridge.latest_cuda(ptr, pitch)  # output comes back in the input's layout and size
        scriptOp.copyCUDAMemory(ptr, nbytes, shape)
        return status

    def _use_cuda(self) -> bool:
        return self.bridge.config.transport == "cuda-ipc"

    def _publish(self, status: Any) -> None:
        par = self.ownerComp.par
        par.State = status.state
        par.Fps = round(float(status.fps or 0.0), 2)
        par.Latency = round(float(status.latency_ms or 0.0), 1)
        par.Dropped = int(status.dropped or 0)
        par.Message = self._message(status.message)
        tail = status.log_tail or ""
        if isinstance(tail, (list, tuple)):
            tail = "\n".join(tail)
        par.Log = "\n".join(str(tail).splitlines()[-LOG_TAIL_LINES:])

    def _error(self, text: str) -> None:
        self.last_error = text
        self.ownerComp.par.State = "error"
        self.ownerComp.par.Message = text


class DeviceBuffer:
    """One cudaMalloc'd buffer in TouchDesigner's process that the engine's output is copied into.

    `scriptTOP.copyCUDAMemory` copies from it into the TOP during the cook, so the buffer must
    outlive the cook; it is reallocated only when the frame size changes.
    """

    def __init__(self) -> None:
        from host_bridge.wire.rings.cuda import check, cudart

        if cudart is None:
            raise RuntimeError("the cuda-ipc transport needs cuda-python in TouchDesigner's Python")
        self._check, self._cudart = check, cudart
        self.ptr = 0
        self.nbytes = 0

    def ensure(self, nbytes: int) -> int:
        if nbytes != self.nbytes:
            self.close()
            self.ptr = int(self._check(self._cudart.cudaMalloc(nbytes), "cudaMalloc"))
            self.nbytes = nbytes
        return self.ptr

    def close(self) -> None:
        if self.ptr:
            self._check(self._cudart.cudaFree(self.ptr), "cudaFree")
            self.ptr, self.nbytes = 0, 0
