"""Stand-ins for the TouchDesigner objects the Loom operator touches, shared by the TD tests.

TouchDesigner is not available here, so the documented behaviour of the objects the adapter
touches is reproduced (derivative.ca: TOP.cudaMemory, CUDAMemory, CUDAMemoryShape, TOP.numpyArray,
scriptTOP.copyNumpyArray / copyCUDAMemory, custom parameter pages):
- `cudaMemory()` returns a CUDAMemory that owns a copy of the texture; the memory is freed when
  the object is dropped, and TD reuses the texture after the cook. The stand-in models device
  memory as a table of live allocations: reading a freed pointer fails, as it would on a GPU.
- uint8 4-channel textures are BGRA in CUDA memory (the only place the docs name BGRA), everything
  else RGBA; rows bottom-up; `numpyArray()` hands out float32 RGBA in 0..1, and with `delayed=True`
  the previous call's download (None on the first call) so the GPU is not stalled.
- `cudaMemory()` refuses 16-bit float textures (TD 2025 raises for rgba16float), and takes a stream.
- `copyNumpyArray` accepts [H, W, 1..4] uint8/uint16/float32 only, only inside a cook, and fills
  the TOP's R, G, B, A from the array's channels in that order (the docs name no other order).
- Cook on demand (derivative.ca "Cook"): a node cooks only with a cook request (a viewer, a
  downstream node that cooks, or `cook(force=True)`) and a reason (its input changed). `Timeline`
  runs one TD frame: Execute DATs' `onFrameStart`, then the Script TOP only if something asks.
- Parameter Execute DATs fire for every value change of the parameters they watch, read-only
  ones included (read-only stops the user, not scripts); `Par.help` is read-only and raises.
- DATs hold source text; TD runs a DAT's text as a module whose globals include `me`.
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

from loom_live.plugin.touchdesigner import script_top_callbacks
from loom_live.plugin.touchdesigner.loom_ext import LoomExt

TD_PAR_NAME = re.compile(r"^[A-Z][a-z0-9]*$")
# A cook must never wait on the engine (its start or stop takes seconds); a cook that does not wait
# takes milliseconds, so this bound catches a wait and leaves room for a loaded 2-core CI box.
COOK_BUDGET_S = 0.5


# --- the stand-in -------------------------------------------------------------------------------


class DeviceMemory:
    """Fake device allocations: pointer -> bytes. Reading a freed pointer is an error, like a GPU fault."""

    def __init__(self) -> None:
        self.live: dict[int, np.ndarray] = {}
        self._next = itertools.count(0x7F00_0000_0000, 0x100_0000)
        self.freed = 0

    def alloc(self, data: np.ndarray) -> int:
        ptr = next(self._next)
        self.live[ptr] = np.ascontiguousarray(data).view(np.uint8).reshape(-1).copy()
        return ptr

    def free(self, ptr: int) -> None:
        if self.live.pop(ptr, None) is not None:
            self.freed += 1

    def read(self, ptr: int, size: int) -> np.ndarray:
        if ptr not in self.live:
            raise RuntimeError(f"read of freed CUDA memory at {ptr:#x} (CUDAMemory dropped or cook ended)")
        if size > self.live[ptr].size:
            raise RuntimeError(f"read of {size} bytes past an allocation of {self.live[ptr].size}")
        return self.live[ptr][:size]


DEVICE = DeviceMemory()


class TDError(Exception):
    """What TouchDesigner's Python raises for a refused call (td.tdError)."""


class CUDAMemoryShape:
    def __init__(self, width: int = 0, height: int = 0, numComps: int = 4, dataType: Any = np.uint8) -> None:
        self.width, self.height, self.numComps, self.dataType = width, height, numComps, dataType
        self.depth, self.isCube, self.is3D = 1, False, False


class CUDAMemory:
    """Owns its allocation; TD frees it when the Python object is destructed."""

    def __init__(self, ptr: int, size: int, shape: CUDAMemoryShape) -> None:
        self._ptr, self._size, self._shape = ptr, size, shape

    ptr = property(lambda self: self._ptr)
    size = property(lambda self: self._size)
    shape = property(lambda self: self._shape)

    def __del__(self) -> None:
        DEVICE.free(self._ptr)


class InputTOP:
    """A TOP holding a texture in TD's layout: bottom-up, BGRA for uint8 RGBA otherwise."""

    def __init__(self, texture: np.ndarray) -> None:
        self.texture = texture
        self.handed_out: list[int] = []
        self.version = 0  # bumped by set(): the cook reason for whatever reads this TOP
        self.numpy_calls: list[bool] = []  # the `delayed` flag of each numpyArray call
        self.cuda_streams: list[Any] = []  # the stream of each cudaMemory call
        self._delayed: np.ndarray | None = None

    def set(self, texture: np.ndarray) -> None:
        self.texture = texture
        self.version += 1

    @property
    def width(self) -> int:
        return self.texture.shape[1]

    @property
    def height(self) -> int:
        return self.texture.shape[0]

    def numpyArray(self, delayed: bool = False, writable: bool = False) -> np.ndarray | None:
        self.numpy_calls.append(delayed)
        t = self.texture
        if t.dtype == np.uint8 and t.shape[2] == 4:
            t = t[:, :, [2, 1, 0, 3]]  # BGRA in memory, numpyArray gives RGBA
        scale = 255.0 if t.dtype == np.uint8 else 65535.0 if t.dtype == np.uint16 else 1.0
        values = t.astype(np.float32) / np.float32(scale)
        if delayed:  # this call starts a download; the last one's result comes back
            values, self._delayed = self._delayed, values
        return values

    def cudaMemory(self, stream: int | None = None) -> CUDAMemory:
        self.cuda_streams.append(stream)
        if self.texture.dtype == np.float16:
            raise TDError("cudaMemory: 16-bit float pixel formats are not supported")
        ptr = DEVICE.alloc(self.texture)
        self.handed_out.append(ptr)
        h, w, c = self.texture.shape
        return CUDAMemory(ptr, self.texture.nbytes, CUDAMemoryShape(w, h, c, self.texture.dtype.type))

    def end_cook(self) -> None:
        """TD reuses the texture after the cook: whatever was handed out is no longer valid."""
        for ptr in self.handed_out:
            DEVICE.free(ptr)
        self.handed_out.clear()


class Par:
    def __init__(self, owner: Any, name: str, style: str) -> None:
        self.owner, self.name, self.style = owner, name, style
        self.val: Any = None
        self.default: Any = None
        self.min = self.max = self.normMin = self.normMax = None
        self.clampMin = self.clampMax = False
        self.readOnly = False
        self.menuNames: list[str] = []
        self.menuLabels: list[str] = []
        self.expr = ""

    @property
    def help(self) -> str:
        return ""

    @help.setter
    def help(self, value: str) -> None:
        raise TDError("td.Par.help is read-only")

    def eval(self) -> Any:
        return self.val

    def pulse(self) -> None:
        self.owner.parexec_pulse(self)


# The built-in parameters (by their Python names on derivative.ca) the build script sets, per OP type
BUILTIN_PARS = {
    "baseCOMP": ("extension1", "promoteextension1"),
    "scriptTOP": ("callbacks",),
    "switchTOP": ("index",),
    "parameterexecuteDAT": ("op", "pars", "valuechange", "onpulse"),
    "executeDAT": ("framestart",),
}


class ParCollection:
    def __init__(self, owner: Any, optype: str = "baseCOMP") -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_pars", {n: Par(owner, n, "Builtin") for n in BUILTIN_PARS.get(optype, ())})

    def __getattr__(self, name: str) -> Par:
        try:
            return self._pars[name]
        except KeyError:
            raise AttributeError(f"no parameter {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        par = getattr(self, name)
        old, par.val = par.val, value
        if old != value:
            self._owner.parexec_change(par, old)


class Page:
    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name = owner, name

    def _append(self, style: str, name: str, label: str = "") -> list[Par]:
        if not TD_PAR_NAME.match(name):
            raise ValueError(f"invalid custom parameter name {name!r}")
        par = Par(self.owner, name, style)
        self.owner.par._pars[name] = par
        return [par]

    def __getattr__(self, attr: str):
        if attr.startswith("append"):
            style = attr[len("append"):]
            if style in ("Str", "Int", "Float", "Toggle", "Pulse", "File", "Folder", "Menu", "TOP"):
                return lambda name, label="": self._append(style, name, label)
        raise AttributeError(attr)


class LoomComp:
    """The Base COMP: custom pars, the extension, and a Parameter Execute DAT wired to it."""

    def __init__(self) -> None:
        self.par = ParCollection(self)
        self.customPages: list[Page] = []
        self.ext = SimpleNamespace()
        self.parexec_enabled = False
        self.parexec_pars = "*"  # the Parameter Execute DAT's Parameters field
        self.parexec_fired: list[str] = []
        self.children: dict[str, Any] = {}

    def op(self, name: str) -> Any:
        return self.children.get(name.removeprefix("./"))

    def appendCustomPage(self, name: str) -> Page:
        page = Page(self, name)
        self.customPages.append(page)
        return page

    def parexec_change(self, par: Par, prev: Any) -> None:
        watched = self.parexec_pars == "*" or par.name in self.parexec_pars.split()
        if self.parexec_enabled and par.style not in ("Pulse", "Builtin") and watched:
            from loom_live.plugin.touchdesigner import parexec_callbacks

            self.parexec_fired.append(par.name)
            parexec_callbacks.onValueChange(par, prev)

    def parexec_pulse(self, par: Par) -> None:
        from loom_live.plugin.touchdesigner import parexec_callbacks

        parexec_callbacks.onPulse(par)


class ScriptTOP:
    """The Script TOP: copyNumpyArray / copyCUDAMemory only inside its cook."""

    def __init__(self, comp: LoomComp, source: InputTOP | None) -> None:
        self._comp = comp
        self.inputs = [source] if source is not None else []
        self.output: np.ndarray | None = None
        self.cooking = False
        self.cooks = 0
        self.viewed = False  # a viewer or a downstream node that cooks asks for this TOP
        self.cuda_streams: list[Any] = []
        self._cooked_version = -1

    def parent(self) -> LoomComp:
        return self._comp

    def copyNumpyArray(self, array: np.ndarray) -> None:
        if not self.cooking:
            raise RuntimeError("copyNumpyArray outside the cook")
        if not (isinstance(array, np.ndarray) and array.ndim == 3 and 1 <= array.shape[2] <= 4):
            raise ValueError(f"copyNumpyArray: shape {getattr(array, 'shape', None)} is not [h, w, 1..4]")
        if array.dtype not in (np.uint8, np.uint16, np.float32):
            raise ValueError(f"copyNumpyArray: dtype {array.dtype} is not uint8, uint16 or float32")
        self.output = array.copy()

    def copyCUDAMemory(self, address: int, size: int, shape: CUDAMemoryShape, stream: int | None = None) -> None:
        if not self.cooking:
            raise RuntimeError("copyCUDAMemory outside the cook")
        self.cuda_streams.append(stream)
        data = DEVICE.read(address, size)
        self.output = data.view(np.dtype(shape.dataType)).reshape(shape.height, shape.width, shape.numComps).copy()

    def cook(self, force: bool = True, recurse: bool = False) -> float:
        """`OP.cook`: cook now through the callbacks DAT (tests: returns the cook's duration)."""
        self.cooking = True
        self.cooks += 1
        self._cooked_version = self.inputs[0].version if self.inputs else 0
        start = time.perf_counter()
        try:
            script_top_callbacks.onCook(self)
        finally:
            self.cooking = False
            for top in self.inputs:
                top.end_cook()
        return time.perf_counter() - start


    def wants_cook(self) -> bool:
        """A cook request (something views it) and a reason (its input changed since the last cook)."""
        changed = bool(self.inputs) and self.inputs[0].version != self._cooked_version
        return self.viewed and changed


class Timeline:
    """TouchDesigner's frame loop for one component: Execute DATs' onFrameStart, then the nodes
    upstream cook (a new input frame, if any), then the Script TOP if something asks for it."""

    def __init__(self, comp: LoomComp, script: ScriptTOP) -> None:
        self.comp, self.script, self.frame = comp, script, 0
        self.execute_dats: list[Any] = []  # modules with onFrameStart(frame)

    def step(self, texture: np.ndarray | None = None) -> None:
        self.frame += 1
        for dat in self.execute_dats:
            dat.onFrameStart(self.frame)
        if texture is not None:
            self.script.inputs[0].set(texture)
        if self.script.wants_cook():
            self.script.cook(force=False)


def make_component(source: InputTOP | None) -> tuple[LoomComp, ScriptTOP, LoomExt]:
    from loom_live.plugin.touchdesigner.loom_ext import PAREXEC_PARS, SCRIPT_TOP

    comp = LoomComp()
    script = ScriptTOP(comp, source)
    comp.children[SCRIPT_TOP] = script
    comp.parexec_pars = PAREXEC_PARS  # what build_loom.py writes into the Parameter Execute DAT
    script_top_callbacks.onSetupParameters(script)
    comp.ext.LoomExt = LoomExt(comp)
    comp.parexec_enabled = True
    return comp, script, comp.ext.LoomExt


def td_texture(h: int, w: int, dtype: Any = np.uint8, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    rgba[..., 3] = 255
    if dtype == np.uint8:
        return rgba[:, :, [2, 1, 0, 3]].copy()  # stored BGRA
    if dtype == np.uint16:
        return rgba.astype(np.uint16) * 257
    return rgba.astype(np.float32) / 255.0




# --- driving the component ----------------------------------------------------------------------


def configure(comp: LoomComp, transport: str = "shm") -> None:
    """Point the component at this Python's pass-through engine, without firing parameter callbacks."""
    comp.parexec_enabled = False
    comp.par.Enginepython = sys.executable
    comp.par.Transport = transport
    comp.par.Passthrough = True
    comp.parexec_enabled = True


def running(comp: LoomComp) -> bool:
    """The component says running and its bridge has received an engine output."""
    bridge = comp.ext.LoomExt.bridge
    return comp.par.State.eval() == "running" and bridge is not None and bridge.stats()["received"] > 0


def cook_until(script: ScriptTOP, ready: Callable[[], bool], what: str, timeout_s: float = 30.0) -> list[float]:
    """Cook (as TD does every frame) until `ready()`; returns each cook's duration."""
    durations = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        durations.append(script.cook())
        if ready():
            return durations
        time.sleep(0.02)
    comp = script.parent()
    raise AssertionError(f"{what} not within {timeout_s} s: {comp.par.State.eval()} {comp.par.Message.eval()} "
                         f"{comp.par.Log.eval()}")


def cook_until_running(script: ScriptTOP, comp: LoomComp, timeout_s: float = 60.0) -> list[float]:
    return cook_until(script, lambda: running(comp), "engine running", timeout_s)


def start_device_bridge(comp: LoomComp, ext: Any) -> None:
    """The component on cuda-ipc with the real bridge and pass-through engine behind it, its device calls done
    on the stand-in's memory (`DeviceCopyingBridge`, `StandInDeviceBuffer`)."""
    from loom_live.host_bridge import Bridge, BridgeConfig

    comp.parexec_enabled = False
    comp.par.Transport = "cuda-ipc"
    comp.parexec_enabled = True
    bridge = Bridge(BridgeConfig(transport="shm", passthrough=True, engine_python=sys.executable))
    bridge.start()
    ext.bridge = DeviceCopyingBridge(bridge)
    ext.device_output = StandInDeviceBuffer()


class DeviceCopyingBridge:
    """The real bridge, with the CUDA calls doing on the stand-in's device memory what they do on a GPU.

    `submit_cuda` copies the frame out of the pointer before it returns; `latest_cuda` copies the
    newest output (or the fallback) into a device buffer in the input's layout. A pointer the
    adapter has already let TD free makes the copy fail, as it would on the GPU.
    """

    def __init__(self, bridge: Any) -> None:
        self._bridge = bridge
        self.config = SimpleNamespace(transport="cuda-ipc", max_frame_side=bridge.config.max_frame_side)
        self.cuda_calls: list[dict[str, Any]] = []
        self.streams: list[tuple[str, Any]] = []
        self.queued: list[tuple[str, bool]] = []  # per call: whether the adapter asked for a queued copy
        self._layout: tuple[np.dtype, int] | None = None

    def submit_cuda(self, ptr: int, pitch: int, width: int, height: int, channels: int, dtype: str,
                    *, layout: str = "rgb", stream: Any = None, control: Any = None, keep: Any = None) -> bool:
        frame = _device_frame(ptr, pitch, width, height, channels, dtype)  # copied now: `keep` is not held
        self.cuda_calls.append({"pitch": pitch, "width": width, "height": height, "channels": channels,
                                "dtype": dtype, "layout": layout})
        self.streams.append(("submit_cuda", stream))
        self.queued.append(("submit_cuda", keep is not None))
        self._layout = (np.dtype(dtype), channels)
        if control is not None:  # a VACE control frame (host_bridge.newest_frames.DeviceFrame)
            self.streams.append(("submit_cuda control", stream))
            control = _device_frame(control.ptr, control.pitch, control.width, control.height, control.channels,
                                    control.dtype)
        return self._bridge.submit(frame, layout=layout, control=control)

    def latest_cuda(self, ptr: int, pitch: int | None = None, *, stream: Any = None, wait: bool = True) -> Any:
        from loom_live.host_bridge.wire.pixels import to_touchdesigner

        self.streams.append(("latest_cuda", stream))
        self.queued.append(("latest_cuda", not wait))
        frame, status = self._bridge.latest()
        dtype, channels = self._layout
        data = to_touchdesigner(frame, dtype, channels).view(np.uint8).reshape(-1)
        if ptr not in DEVICE.live or DEVICE.live[ptr].size < data.size:
            raise RuntimeError("latest_cuda into a freed or too small buffer")
        DEVICE.live[ptr][: data.size] = data
        return status

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bridge, name)


def _device_frame(ptr: int, pitch: int, width: int, height: int, channels: int, dtype: str) -> np.ndarray:
    """A copy of a frame in the stand-in's device memory (fails for a pointer TD has freed)."""
    raw = DEVICE.read(ptr, pitch * height)
    frame = raw.view(np.dtype(dtype)).reshape(height, pitch // np.dtype(dtype).itemsize)
    return frame[:, : width * channels].reshape(height, width, channels).copy()


class StandInDeviceBuffer:
    """The extension's output buffer, allocated in the stand-in's device memory instead of cudaMalloc."""

    STREAM = 0x57_2EA4  # a stand-in cudaStream_t handle

    def __init__(self) -> None:
        self.ptr, self.nbytes = 0, 0
        self.stream = self.STREAM

    def ensure(self, nbytes: int) -> int:
        if nbytes != self.nbytes:
            self.close()
            self.ptr, self.nbytes = DEVICE.alloc(np.zeros(nbytes, np.uint8)), nbytes
        return self.ptr

    def close(self) -> None:
        DEVICE.free(self.ptr)
        self.ptr, self.nbytes = 0, 0


# --- a network, for build_loom.py ---------------------------------------------------------------

OP_TYPES = ("baseCOMP", "scriptTOP", "textDAT", "parameterexecuteDAT", "executeDAT", "inTOP", "outTOP", "switchTOP")


def fake_td_module() -> SimpleNamespace:
    """TouchDesigner's `td` module as far as creating operators goes: one type object per OP type."""
    return SimpleNamespace(**{name: SimpleNamespace(name=name) for name in OP_TYPES})


class Connector:
    def __init__(self, owner: Any, index: int) -> None:
        self.owner, self.index = owner, index

    def connect(self, target: Any) -> None:
        inputs = self.owner.inputs
        inputs.extend([None] * (self.index + 1 - len(inputs)))
        inputs[self.index] = target


class NetworkOP:
    """A non-COMP operator: `.par` (built-in parameters, `.expr`), DAT `.text`, input connectors."""

    def __init__(self, optype: str, name: str, parent: Any) -> None:
        self.OPType, self.name, self._parent = optype, name, parent
        self.par = ParCollection(self, optype)
        self.text = ""
        self.inputs: list[Any] = []
        self.inputConnectors = [Connector(self, i) for i in range(4)]

    def parent(self) -> Any:
        return self._parent

    @property
    def path(self) -> str:
        return f"{self._parent.path}/{self.name}"

    @property
    def module(self) -> SimpleNamespace:
        """A DAT's text run as a module, with `me` set as TouchDesigner does."""
        namespace: dict[str, Any] = {"me": self, "__name__": self.name}
        exec(compile(self.text, self.path, "exec"), namespace)
        return SimpleNamespace(**namespace)

    def parexec_change(self, par: Par, prev: Any) -> None:
        pass


class NetworkCOMP(LoomComp):
    """A COMP that creates operators inside it (`OP.create(type, name)`), as in the Textport."""

    def __init__(self, name: str = "project1", parent: Any = None) -> None:
        super().__init__()
        self.name, self._parent, self.OPType = name, parent, "baseCOMP"

    def parent(self) -> Any:
        return self._parent

    @property
    def path(self) -> str:
        return f"{self._parent.path}/{self.name}" if self._parent is not None else f"/{self.name}"

    def create(self, optype: Any, name: str) -> Any:
        if name in self.children:
            raise TDError(f"{self.path}/{name} already exists")
        node = NetworkCOMP(name, self) if optype.name == "baseCOMP" else NetworkOP(optype.name, name, self)
        self.children[name] = node
        if optype.name == "scriptTOP":  # TD docks a callbacks DAT named after the Script TOP
            self.children[f"{name}_callbacks"] = NetworkOP("textDAT", f"{name}_callbacks", self)
        return node
