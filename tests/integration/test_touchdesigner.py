"""The TouchDesigner adapter against a faithful stand-in for the `td` objects it uses, and a real engine.

TouchDesigner is not available here, so the documented behaviour of the objects the adapter
touches is reproduced (derivative.ca: TOP.cudaMemory, CUDAMemory, CUDAMemoryShape, TOP.numpyArray,
scriptTOP.copyNumpyArray / copyCUDAMemory, custom parameter pages):
- `cudaMemory()` returns a CUDAMemory that owns a copy of the texture; the memory is freed when
  the object is dropped, and TD reuses the texture after the cook. The stand-in models device
  memory as a table of live allocations: reading a freed pointer fails, as it would on a GPU.
- uint8 4-channel textures are BGRA, everything else RGBA; rows bottom-up; `numpyArray()` hands
  out float32 RGBA in 0..1.
- `copyNumpyArray` accepts [H, W, 1..4] uint8/uint16/float32 only, and only inside a cook.
Everything except TD itself is real: host_bridge, the engine process, the shm transport.
"""

from __future__ import annotations

import gc
import itertools
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from host_bridge.wire.params import steps_for
from host_bridge.wire.pixels import from_touchdesigner, to_engine
from plugin.touchdesigner import script_top_callbacks
from plugin.touchdesigner.loom_ext import LoomExt
from plugin.touchdesigner.parameters import PARAMETERS, setup_parameters

ROOT = Path(__file__).resolve().parents[2]
TD_PAR_NAME = re.compile(r"^[A-Z][a-z0-9]*$")
COOK_BUDGET_S = 0.25  # a cook must never wait on the engine; generous for a loaded 2-core CI box


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

    @property
    def width(self) -> int:
        return self.texture.shape[1]

    @property
    def height(self) -> int:
        return self.texture.shape[0]

    def numpyArray(self, delayed: bool = False, writable: bool = False) -> np.ndarray:
        t = self.texture
        if t.dtype == np.uint8 and t.shape[2] == 4:
            t = t[:, :, [2, 1, 0, 3]]  # BGRA in memory, numpyArray gives RGBA
        values = t.astype(np.float32) / (255.0 if t.dtype == np.uint8 else 65535.0 if t.dtype == np.uint16 else 1.0)
        return values

    def cudaMemory(self, stream: int | None = None) -> CUDAMemory:
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
        self.help = ""

    def eval(self) -> Any:
        return self.val

    def pulse(self) -> None:
        self.owner.parexec_pulse(self)


class ParCollection:
    def __init__(self, owner: Any) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_pars", {})

    def __getattr__(self, name: str) -> Par:
        try:
            return self._pars[name]
        except KeyError:
            raise AttributeError(f"no parameter {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        par = self._pars[name]
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
            if style in ("Str", "Int", "Float", "Toggle", "Pulse", "File", "Folder", "Menu"):
                return lambda name, label="": self._append(style, name, label)
        raise AttributeError(attr)


class LoomComp:
    """The Base COMP: custom pars, the extension, and a Parameter Execute DAT wired to it."""

    def __init__(self) -> None:
        self.par = ParCollection(self)
        self.customPages: list[Page] = []
        self.ext = SimpleNamespace()
        self.parexec_enabled = False

    def appendCustomPage(self, name: str) -> Page:
        page = Page(self, name)
        self.customPages.append(page)
        return page

    def parexec_change(self, par: Par, prev: Any) -> None:
        if self.parexec_enabled and par.style != "Pulse" and not par.readOnly:
            from plugin.touchdesigner import parexec_callbacks

            parexec_callbacks.onValueChange(par, prev)

    def parexec_pulse(self, par: Par) -> None:
        from plugin.touchdesigner import parexec_callbacks

        parexec_callbacks.onPulse(par)


class ScriptTOP:
    """The Script TOP: copyNumpyArray / copyCUDAMemory only inside its cook."""

    def __init__(self, comp: LoomComp, source: InputTOP | None) -> None:
        self._comp = comp
        self.inputs = [source] if source is not None else []
        self.output: np.ndarray | None = None
        self.cooking = False

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
        data = DEVICE.read(address, size)
        self.output = data.view(np.dtype(shape.dataType)).reshape(shape.height, shape.width, shape.numComps).copy()

    def cook(self) -> float:
        """One TD cook through the callbacks DAT; returns its duration."""
        self.cooking = True
        start = time.perf_counter()
        try:
            script_top_callbacks.onCook(self)
        finally:
            self.cooking = False
            for top in self.inputs:
                top.end_cook()
        return time.perf_counter() - start


def _make_component(source: InputTOP | None) -> tuple[LoomComp, ScriptTOP, LoomExt]:
    comp = LoomComp()
    script = ScriptTOP(comp, source)
    script_top_callbacks.onSetupParameters(script)
    comp.ext.LoomExt = LoomExt(comp)
    comp.parexec_enabled = True
    return comp, script, comp.ext.LoomExt


def _td_texture(h: int, w: int, dtype: Any = np.uint8, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
    rgba[..., 3] = 255
    if dtype == np.uint8:
        return rgba[:, :, [2, 1, 0, 3]].copy()  # stored BGRA
    if dtype == np.uint16:
        return rgba.astype(np.uint16) * 257
    return rgba.astype(np.float32) / 255.0


# --- parameters ---------------------------------------------------------------------------------


def test_setup_creates_the_documented_parameters_and_keeps_user_values():
    comp, script, _ = _make_component(None)
    names = set(comp.par._pars)
    for required in ("Prompt", "Steps", "Noisescale", "Motionaware", "Enginepython", "Config", "Start", "Stop",
                     "State", "Fps", "Latency", "Dropped", "Log", "Active", "Transport"):
        assert required in names
    assert all(TD_PAR_NAME.match(n) for n in names)
    assert comp.par.Steps.min == 1 and comp.par.Steps.max == 4 and comp.par.Steps.clampMax
    assert comp.par.Transport.menuNames == ["cuda-ipc", "shm", "tcp"]
    assert comp.par.State.readOnly and comp.par.Log.readOnly and not comp.par.Prompt.readOnly
    comp.parexec_enabled = False
    comp.par.Prompt = "my own prompt"
    setup_parameters(comp)  # the 'Setup Parameters' pulse again
    assert comp.par.Prompt.eval() == "my own prompt"
    assert {p.name for p in PARAMETERS} == names


def test_inactive_component_passes_the_input_through():
    texture = _td_texture(24, 32)
    comp, script, ext = _make_component(InputTOP(texture))
    script.cook()
    assert ext.bridge is None
    expected = texture[:, :, [2, 1, 0, 3]].astype(np.float32) / 255.0
    np.testing.assert_array_equal(script.output, expected)


# --- with a real engine -------------------------------------------------------------------------


def _configure(comp: LoomComp, transport: str = "shm") -> None:
    comp.parexec_enabled = False
    comp.par.Enginepython = sys.executable
    comp.par.Transport = transport
    comp.par.Passthrough = True
    comp.parexec_enabled = True


def _cook_until_running(script: ScriptTOP, comp: LoomComp, timeout_s: float = 60.0) -> list[float]:
    durations = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        durations.append(script.cook())
        if comp.par.State.eval() == "running" and comp.ext.LoomExt.bridge.stats()["received"] > 0:
            return durations
        time.sleep(0.02)
    raise AssertionError(f"engine not running after {timeout_s} s: {comp.par.State.eval()} "
                         f"{comp.par.Message.eval()} {comp.par.Log.eval()}")


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_numpy_path_round_trip_is_exact_in_td_layout(dtype):
    texture = _td_texture(40, 56, dtype, seed=3)
    source = InputTOP(texture)
    comp, script, ext = _make_component(source)
    _configure(comp)
    comp.par.Active = True  # Parameter Execute DAT -> ext.OnParValueChange -> Start
    try:
        durations = _cook_until_running(script, comp)
        assert max(durations) < COOK_BUDGET_S, "a cook waited on the engine"
        for _ in range(5):  # a few more frames so the newest output is this texture's
            script.cook()
            time.sleep(0.05)
        out = script.output
        assert out.dtype == np.uint8 and out.shape == (40, 56, 4)  # uint8 BGRA, bottom-up, like a TD TOP
        want = from_touchdesigner(texture)  # engine view (RGB top-down) of the input
        np.testing.assert_array_equal(to_engine(out, order="BGRA", bottom_up=True), want)
        assert ext.numpy_submits > 0 and ext.cuda_submits == 0
        assert comp.par.Fps.eval() >= 0 and comp.par.Dropped.eval() >= 0
        comp.par.Prompt = "ink wash"  # a live change reaches the engine process
        comp.par.Steps = 3
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            script.cook()
            session = ext.bridge.stats()["engine"].get("session") or {}
            if session.get("prompt") == "ink wash" and session["params"].get("steps") == steps_for(3):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"engine never got the new prompt/steps: {ext.bridge.stats()['engine']}")
    finally:
        comp.par.Active = False
    assert ext.bridge is None and comp.par.State.eval() == "stopped"


class DeviceCopyingBridge:
    """The real bridge, with the CUDA calls doing on the stand-in's device memory what they do on a GPU.

    `submit_cuda` copies the frame out of the pointer before it returns; `latest_cuda` copies the
    newest output (or the fallback) into a device buffer in the input's layout. A pointer the
    adapter has already let TD free makes the copy fail, as it would on the GPU.
    """

    def __init__(self, bridge: Any) -> None:
        self._bridge = bridge
        self.config = SimpleNamespace(transport="cuda-ipc")
        self.cuda_calls: list[dict[str, Any]] = []
        self._layout: tuple[np.dtype, int] | None = None

    def submit_cuda(self, ptr: int, pitch: int, width: int, height: int, channels: int, dtype: str,
                    *, layout: str = "rgb") -> bool:
        raw = DEVICE.read(ptr, pitch * height)
        frame = raw.view(np.dtype(dtype)).reshape(height, pitch // np.dtype(dtype).itemsize)
        frame = frame[:, : width * channels].reshape(height, width, channels)
        self.cuda_calls.append({"pitch": pitch, "width": width, "height": height, "channels": channels,
                                "dtype": dtype, "layout": layout})
        self._layout = (np.dtype(dtype), channels)
        return self._bridge.submit(frame.copy(), layout=layout)

    def latest_cuda(self, ptr: int, pitch: int | None = None) -> Any:
        from host_bridge.wire.pixels import to_touchdesigner

        frame, status = self._bridge.latest()
        dtype, channels = self._layout
        data = to_touchdesigner(frame, dtype, channels).view(np.uint8).reshape(-1)
        if ptr not in DEVICE.live or DEVICE.live[ptr].size < data.size:
            raise RuntimeError("latest_cuda into a freed or too small buffer")
        DEVICE.live[ptr][: data.size] = data
        return status

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bridge, name)


class StandInDeviceBuffer:
    """The extension's output buffer, allocated in the stand-in's device memory instead of cudaMalloc."""

    def __init__(self) -> None:
        self.ptr, self.nbytes = 0, 0

    def ensure(self, nbytes: int) -> int:
        if nbytes != self.nbytes:
            self.close()
            self.ptr, self.nbytes = DEVICE.alloc(np.zeros(nbytes, np.uint8)), nbytes
        return self.ptr

    def close(self) -> None:
        DEVICE.free(self.ptr)
        self.ptr, self.nbytes = 0, 0


def test_stand_in_enforces_the_cudamemory_lifetime_rule():
    """The stand-in must catch an adapter that lets go of CUDAMemory too early, or keeps a pointer past the cook."""
    top = InputTOP(_td_texture(4, 4))
    memory = top.cudaMemory()
    ptr, size = memory.ptr, memory.size
    assert DEVICE.read(ptr, size).size == size
    del memory
    with pytest.raises(RuntimeError, match="freed"):
        DEVICE.read(ptr, size)
    kept = top.cudaMemory()
    top.end_cook()  # TD reuses the texture after the cook, even if Python still holds the object
    with pytest.raises(RuntimeError, match="freed"):
        DEVICE.read(kept.ptr, kept.size)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.float32])
def test_cuda_path_copies_device_to_device_and_respects_cudamemory_lifetime(dtype):
    from host_bridge import Bridge, BridgeConfig

    texture = _td_texture(32, 48, dtype, seed=5)
    source = InputTOP(texture)
    comp, script, ext = _make_component(source)
    comp.parexec_enabled = False
    comp.par.Transport = "cuda-ipc"
    live_before = set(DEVICE.live)
    bridge = Bridge(BridgeConfig(transport="shm", passthrough=True, engine_python=sys.executable))
    bridge.start()
    ext.bridge = DeviceCopyingBridge(bridge)
    ext.device_output = StandInDeviceBuffer()
    try:
        durations = _cook_until_running(script, comp)
        assert max(durations) < COOK_BUDGET_S
        for _ in range(5):
            script.cook()
            time.sleep(0.05)
        gc.collect()
        # every CUDAMemory TD handed out is gone; only the extension's output buffer is alive
        assert set(DEVICE.live) - live_before == {ext.device_output.ptr}
        itemsize = np.dtype(dtype).itemsize
        assert ext.bridge.cuda_calls[0] == {"pitch": 48 * 4 * itemsize, "width": 48, "height": 32, "channels": 4,
                                            "dtype": np.dtype(dtype).name, "layout": "touchdesigner"}
        assert ext.numpy_submits == 0 and ext.cuda_submits == len(ext.bridge.cuda_calls)
        np.testing.assert_array_equal(script.output, texture)  # passthrough: TD layout in, TD layout out
    finally:
        ext.Stop()
    assert set(DEVICE.live) == live_before


def test_cuda_ipc_without_a_gpu_falls_back_to_shared_memory():
    from host_bridge.wire.rings.cuda import cuda_available

    if cuda_available()[0]:
        pytest.skip("this machine has CUDA: the fallback is not taken")
    texture = _td_texture(16, 24, np.uint8, seed=9)
    comp, script, ext = _make_component(InputTOP(texture))
    _configure(comp, transport="cuda-ipc")
    comp.par.Active = True
    try:
        assert ext.bridge.config.transport == "shm"
        assert "cuda-ipc unavailable" in comp.par.Message.eval()
        _cook_until_running(script, comp)
        assert ext.numpy_submits > 0 and ext.cuda_submits == 0
        assert "cuda-ipc unavailable" in comp.par.Message.eval()  # still said while running
    finally:
        comp.par.Active = False


def test_parameter_changes_reach_the_engine():
    comp, script, ext = _make_component(InputTOP(_td_texture(16, 16)))
    sent: list[tuple[str, Any]] = []
    ext.bridge = SimpleNamespace(set_prompt=lambda text, transition_chunks=None: sent.append(("prompt", text)),
                                 set_params=lambda **kw: sent.append(("params", kw)), close=lambda: None,
                                 wanted=None)
    comp.par.Prompt = "liquid chrome"
    comp.par.Steps = 1
    comp.par.Noisescale = 0.5
    assert sent[0] == ("prompt", "liquid chrome")
    assert sent[-1] == ("params", {"steps": steps_for(1), "noise_scale": 0.5, "motion_aware": True})
    comp.par.Stop.pulse()
    assert ext.bridge is None and comp.par.State.eval() == "stopped"


def test_engine_that_cannot_start_shows_an_error_and_never_blocks_the_cook(tmp_path):
    texture = _td_texture(16, 16)
    comp, script, ext = _make_component(InputTOP(texture))
    _configure(comp)
    comp.par.Enginepython = str(tmp_path / "no-such-python")
    comp.par.Start.pulse()
    try:
        durations = [script.cook() for _ in range(20)]
        assert max(durations) < COOK_BUDGET_S
        assert script.output is not None  # the fallback (pass-through) keeps the network fed
        deadline = time.monotonic() + 30
        while comp.par.State.eval() != "dead" and time.monotonic() < deadline:
            script.cook()
            time.sleep(0.05)
        assert comp.par.State.eval() == "dead"
        assert comp.par.Message.eval()
    finally:
        ext.Stop()


def test_missing_engine_python_is_reported_on_the_component():
    comp, script, ext = _make_component(InputTOP(_td_texture(8, 8)))
    comp.parexec_enabled = False
    comp.par.Enginepython = ""
    comp.par.Endpoint = ""
    ext.Start()
    assert ext.bridge is None and comp.par.State.eval() == "error"
    assert "Engine Python" in comp.par.Message.eval()


def test_osc_in_dat_sets_parameters_that_reach_the_engine():
    from plugin.touchdesigner import osc_in_callbacks

    comp, script, ext = _make_component(InputTOP(_td_texture(8, 8)))
    sent: list[tuple[str, Any]] = []
    ext.bridge = SimpleNamespace(set_prompt=lambda text, transition_chunks=None: sent.append(("prompt", text)),
                                 set_params=lambda **kw: sent.append(("params", kw)), close=lambda: None,
                                 wanted=None)
    dat = SimpleNamespace(parent=lambda: comp)
    osc_in_callbacks.onReceiveOSC(dat, 0, "", b"", 0.0, "/loom/prompt", ["velvet"], None)
    osc_in_callbacks.onReceiveOSC(dat, 0, "", b"", 0.0, "/loom/steps", [3], None)
    osc_in_callbacks.onReceiveOSC(dat, 0, "", b"", 0.0, "/loom/unknown", [1], None)  # ignored
    assert comp.par.Prompt.eval() == "velvet" and comp.par.Steps.eval() == 3
    assert sent == [("prompt", "velvet"), ("params", {"steps": steps_for(3), "noise_scale": 0.8,
                                                      "motion_aware": True})]


# --- on a GPU: the same stand-in, with real device memory and the real cuda-ipc transport ---------


class GpuCUDAMemory(CUDAMemory):
    """Like TD's: real device memory, freed (cudaFree) when the object is dropped."""

    def __del__(self) -> None:
        from cuda.bindings import runtime as cudart

        cudart.cudaFree(self._ptr)


class GpuInputTOP(InputTOP):
    def cudaMemory(self, stream: int | None = None) -> CUDAMemory:
        from cuda.bindings import runtime as cudart

        from host_bridge.wire.rings.cuda import check

        data = np.ascontiguousarray(self.texture)
        ptr = int(check(cudart.cudaMalloc(data.nbytes), "cudaMalloc"))
        check(cudart.cudaMemcpy(ptr, data.ctypes.data, data.nbytes, cudart.cudaMemcpyKind.cudaMemcpyHostToDevice),
              "cudaMemcpy")
        h, w, c = data.shape
        return GpuCUDAMemory(ptr, data.nbytes, CUDAMemoryShape(w, h, c, data.dtype.type))

    def end_cook(self) -> None:
        """Real device memory is freed by GpuCUDAMemory itself."""


class GpuScriptTOP(ScriptTOP):
    def copyCUDAMemory(self, address: int, size: int, shape: CUDAMemoryShape, stream: int | None = None) -> None:
        from cuda.bindings import runtime as cudart

        from host_bridge.wire.rings.cuda import check

        if not self.cooking:
            raise RuntimeError("copyCUDAMemory outside the cook")
        host = np.empty(size, np.uint8)
        check(cudart.cudaMemcpy(host.ctypes.data, address, size, cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost),
              "cudaMemcpy")
        self.output = host.view(np.dtype(shape.dataType)).reshape(shape.height, shape.width, shape.numComps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_cuda_ipc_round_trip_on_a_gpu(dtype):
    texture = _td_texture(270, 480, dtype, seed=7)
    comp = LoomComp()
    script = GpuScriptTOP(comp, GpuInputTOP(texture))
    script_top_callbacks.onSetupParameters(script)
    comp.ext.LoomExt = ext = LoomExt(comp)
    comp.parexec_enabled = True
    _configure(comp, transport="cuda-ipc")
    comp.par.Active = True
    try:
        durations = _cook_until_running(script, comp)
        assert max(durations) < COOK_BUDGET_S
        for _ in range(5):
            script.cook()
            time.sleep(0.05)
        assert ext.cuda_submits > 0 and ext.numpy_submits == 0
        np.testing.assert_array_equal(script.output, texture)  # device to device, TD layout kept
    finally:
        comp.par.Active = False
