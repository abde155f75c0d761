"""The TouchDesigner operator under the failures a show meets: bad parameter values, odd input TOPs,
restarts, re-initialised extensions. TouchDesigner's objects are the stand-ins of tests/fakes/touchdesigner.py;
the bridge and the pass-through engine process are real (shm transport).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loom_live.host_bridge.wanted import PromptWish
from loom_live.host_bridge.wire.params import steps_for
from loom_live.host_bridge.wire.pixels import from_touchdesigner, to_engine, touchdesigner_order
from loom_live.plugin.touchdesigner import script_top_callbacks
from loom_live.plugin.touchdesigner.loom_ext import LoomExt
from tests.fakes.engines import InProcessEngine, exiting_engine, python_without_loom, wait_until
from tests.fakes.touchdesigner import (
    COOK_BUDGET_S,
    CUDAMemory,
    CUDAMemoryShape,
    InputTOP,
    LoomComp,
    ScriptTOP,
    configure,
    cook_until,
    cook_until_running,
    make_component,
    running,
    start_device_bridge,
    td_texture,
)


def _engine_session(ext: LoomExt) -> dict[str, Any]:
    return ext.bridge.stats()["engine"].get("session") or {}


def test_invalid_parameter_values_are_refused_on_the_component_and_the_stream_goes_on():
    """An empty or overlong prompt, or out-of-range steps/noise/transition from the UI or OSC: a message on
    the component, the last good value kept, and neither the parameter callback nor any cook raises."""
    comp, script, ext = make_component(InputTOP(td_texture(24, 32)))
    configure(comp)
    comp.par.Prompt = "ink wash"
    comp.par.Steps = 3
    comp.par.Active = True
    try:
        cook_until(script, lambda: running(comp), "engine running")
        bad = [("Prompt", "   ", "prompt"), ("Prompt", "x" * 5000, "prompt"), ("Transition", -3, "transition"),
               ("Steps", 7, "steps"), ("Noisescale", 5.0, "noise_scale"), ("Noisescale", float("nan"), "noise_scale")]
        for name, value, word in bad:
            good = getattr(comp.par, name).eval()
            setattr(comp.par, name, value)  # the Parameter Execute DAT's callback runs here
            for _ in range(3):
                script.cook()
            message = comp.par.Message.eval()
            assert word in message and name in message, (name, value, message)
            comp.parexec_enabled = False
            setattr(comp.par, name, good)  # the user puts it back
            comp.parexec_enabled = True
            setattr(comp.par, name, good)
        wanted = ext.bridge.wanted
        assert wanted.prompt == PromptWish("ink wash", 4)
        assert wanted.params["steps"] == steps_for(3) and wanted.params["noise_scale"] == 0.8
        comp.par.Prompt = "velvet"  # a good value clears the message and reaches the engine
        deadline = time.monotonic() + 10
        while _engine_session(ext).get("prompt") != "velvet" and time.monotonic() < deadline:
            script.cook()
            time.sleep(0.05)
        assert _engine_session(ext).get("prompt") == "velvet"
        assert "prompt" not in comp.par.Message.eval()
        comp.parexec_enabled = False
        comp.par.Steps = 9  # a restart with a bad value on the page: it starts, and says what is wrong
        comp.parexec_enabled = True
        comp.par.Start.pulse()
        cook_until(script, lambda: running(comp), "engine running again")
        assert "Steps" in comp.par.Message.eval() and ext.bridge.wanted.params["steps"] == steps_for(3)
    finally:
        comp.par.Active = False


class FlakyTOP(InputTOP):
    """An input TOP that, for some cooks, has no image to give (disconnected upstream, not cooked yet)."""

    empty = False

    def numpyArray(self, delayed: bool = False, writable: bool = False) -> Any:
        return None if self.empty else super().numpyArray(delayed, writable)

    def cudaMemory(self, stream: int | None = None) -> Any:
        return None if self.empty else super().cudaMemory(stream)


def _output_is(script: ScriptTOP, texture: np.ndarray) -> bool:
    """The pass-through engine's output of `texture`, in the Script TOP (copyNumpyArray: uint8 RGB
    bottom-up; copyCUDAMemory: the input's own layout)."""
    out = script.output
    want = from_touchdesigner(texture) if texture.dtype != np.float16 else from_touchdesigner(
        texture.astype(np.float32))
    if out is None or out.shape[:2] != texture.shape[:2]:
        return False
    order = "RGB" if out.shape[2] == 3 else touchdesigner_order(out.dtype, out.shape[2])
    return np.array_equal(to_engine(out, order=order, bottom_up=True), want)


def test_an_input_with_no_image_never_raises_out_of_the_cook_and_the_stream_comes_back():
    source = FlakyTOP(td_texture(24, 32, seed=1))
    comp, script, ext = make_component(source)
    configure(comp)
    comp.par.Active = True
    try:
        cook_until(script, lambda: running(comp), "engine running")
        source.empty = True
        durations = [script.cook() for _ in range(5)]
        assert max(durations) < COOK_BUDGET_S
        assert "no image" in comp.par.Message.eval()
        source.empty = False
        source.texture = td_texture(24, 32, seed=2)
        cook_until(script, lambda: _output_is(script, source.texture), "output of the returned input")
        assert "no image" not in comp.par.Message.eval()
    finally:
        comp.par.Active = False


def test_16bit_float_input_on_cuda_ipc_comes_back_through_the_cpu_without_raising():
    """TouchDesigner's 16-bit float textures (cudaMemory dataType float16) are not a device format the
    bridge takes: those cooks go through numpyArray(), with a note, and the stream goes on both ways."""
    source = InputTOP(td_texture(24, 32, np.uint8, seed=3))
    comp, script, ext = make_component(source)
    start_device_bridge(comp, ext)
    try:
        cook_until(script, lambda: running(comp), "engine running")
        for texture in (td_texture(24, 32, np.float32, seed=4).astype(np.float16), td_texture(24, 32, seed=5)):
            source.texture = texture
            durations = cook_until(script, lambda t=texture: _output_is(script, t), f"{texture.dtype} output")
            assert max(durations) < COOK_BUDGET_S
            assert ("through the CPU" in comp.par.Message.eval()) == (texture.dtype == np.float16)
    finally:
        ext.Stop()


class BoundedRuntime:
    """The CPU stand-in for cuda-python's runtime (tests/fakes/cuda_runtime.py), where a copy into
    device memory must land inside one allocation: a write past the end is recorded and refused, where a
    GPU would corrupt TouchDesigner's memory or fault."""

    def __init__(self) -> None:
        from tests.fakes.cuda_runtime import FakeRuntime

        self._rt = FakeRuntime()
        self.textures: dict[int, int] = {}  # TD's texture copies handed out by cudaMemory(): ptr -> size
        self.violations: list[str] = []

    def _inside(self, ptr: int, size: int) -> bool:
        spans = [(p, ctypes.sizeof(b)) for p, b in self._rt.buffers.items()] + list(self.textures.items())
        return any(base <= ptr and ptr + size <= base + n for base, n in spans)

    def cudaMemcpy2DAsync(self, dst, dpitch, src, spitch, width, height, kind, stream):  # noqa: N802
        if kind != self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost and not self._inside(
                dst, (height - 1) * dpitch + width):
            self.violations.append(f"{height} rows of {width} bytes (pitch {dpitch}) past the destination")
            raise RuntimeError(self.violations[-1])
        if width > dpitch:
            self.violations.append(f"rows of {width} bytes into a pitch of {dpitch}")
            raise RuntimeError(self.violations[-1])
        return self._rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)


class HostMemoryTOP(InputTOP):
    """cudaMemory() as TD gives it: a copy of the texture the CUDAMemory object owns (here in host memory
    that the stand-in runtime treats as device memory), freed when the object is dropped."""

    def __init__(self, texture: np.ndarray, rt: BoundedRuntime | None = None) -> None:
        super().__init__(texture)
        self.rt = rt  # the runtime its cudaMemory() registers with (set by _on_cuda_ipc)

    def cudaMemory(self, stream: int | None = None) -> Any:
        data = np.ascontiguousarray(self.texture).copy()
        ptr = data.ctypes.data
        self.rt.textures[ptr] = data.nbytes
        h, w, c = data.shape
        memory = HostCUDAMemory(ptr, data.nbytes, CUDAMemoryShape(w, h, c, data.dtype.type))
        memory.keep, memory.rt = data, self.rt
        return memory

    def end_cook(self) -> None:
        """The copies are owned (and freed) by HostCUDAMemory."""


class HostCUDAMemory(CUDAMemory):
    def __del__(self) -> None:
        self.rt.textures.pop(self._ptr, None)


class HostScriptTOP(ScriptTOP):
    def copyCUDAMemory(self, address: int, size: int, shape: Any, stream: int | None = None) -> None:
        if not self.cooking:
            raise RuntimeError("copyCUDAMemory outside the cook")
        rt = self.parent().rt
        if not rt._inside(address, size):
            raise RuntimeError(f"copyCUDAMemory of {size} bytes from outside an allocation")
        data = np.frombuffer(ctypes.string_at(address, size), np.dtype(shape.dataType))
        self.output = data.reshape(shape.height, shape.width, shape.numComps).copy()


def _on_cuda_ipc(monkeypatch, source: HostMemoryTOP):
    """A component streaming `source` over cuda-ipc to an in-process pass-through engine, on the bounds-checking
    stand-in runtime: (engine, comp, script, ext, runtime)."""
    pytest.importorskip("cuda.bindings.runtime", reason="the cuda-ipc ring code needs cuda-python (no GPU)")
    from loom_live.engine.server.passthrough import PassthroughSession
    from loom_live.host_bridge import Bridge, BridgeConfig
    from loom_live.host_bridge.wire.rings import cuda as tc

    rt = BoundedRuntime()
    monkeypatch.setattr(tc, "cudart", rt)
    engine = InProcessEngine(PassthroughSession)
    comp = LoomComp()
    comp.rt = source.rt = rt
    script = HostScriptTOP(comp, source)
    script_top_callbacks.onSetupParameters(script)
    comp.ext.LoomExt = ext = LoomExt(comp)
    ext.bridge = Bridge(BridgeConfig(transport="cuda-ipc", **engine.host, heartbeat_s=0.1, hang_timeout_s=2.0)).start()
    return engine, comp, script, ext, rt


def test_size_and_format_changes_on_cuda_ipc_never_copy_past_the_output_buffer(monkeypatch):
    """The input TOP changes resolution or pixel format mid-show on cuda-ipc: until the engine's first
    output of the new kind arrives, the newest output is of the old size, and the output buffer is sized
    for the new input. Every cook stays inside it, and the new input's restyled frames come back."""
    source = HostMemoryTOP(td_texture(48, 64, seed=1))
    engine, comp, script, ext, rt = _on_cuda_ipc(monkeypatch, source)
    try:
        cook_until(script, lambda: running(comp), "engine running")
        for h, w, dtype in ((24, 64, np.uint8), (48, 32, np.uint8), (48, 32, np.float32), (40, 56, np.uint16),
                            (48, 64, np.uint8)):
            source.texture = texture = td_texture(h, w, dtype, seed=h + w)
            received = ext.bridge.stats()["received"]

            def restyled(t=texture, before=received) -> bool:  # the engine's output of the new input
                out = script.output
                return ext.bridge.stats()["received"] > before + 2 and out is not None and np.array_equal(out, t)

            cook_until(script, restyled, f"{h}x{w} {np.dtype(dtype).name} output", 10)
            assert rt.violations == [], (h, w, dtype, rt.violations)
            assert ext.cuda_submits > 0 and "not taken" not in comp.par.Message.eval()
    finally:
        ext.Stop()
        engine.stop()


@pytest.mark.parametrize("channels, dtype", [(1, np.uint8), (3, np.uint8), (1, np.float32), (3, np.uint16)])
def test_mono_and_3_channel_inputs_on_cuda_ipc_go_device_to_device(monkeypatch, channels, dtype):
    """TouchDesigner's Mono pixel formats (1 channel) and 3-channel textures are device formats the bridge
    takes: their staging and rings name the channels there are (R, RGB), so the engine's frames come back,
    not a refusal every cook with the output frozen."""
    texture = td_texture(18, 26, dtype, seed=channels)[:, :, :channels].copy()
    engine, comp, script, ext, _ = _on_cuda_ipc(monkeypatch, HostMemoryTOP(texture))
    try:
        cook_until(script, lambda: ext.bridge.stats()["received"] > 0 and np.array_equal(script.output, texture),
                   f"{channels}-channel {np.dtype(dtype).name} output", 10)
        assert ext.cuda_submits > 0 and ext.numpy_submits == 0
        assert "refused" not in comp.par.Message.eval() and ext.bridge.stats()["refused_frames"] == 0
    finally:
        ext.Stop()
        engine.stop()


def test_an_input_over_max_frame_side_on_cuda_ipc_is_said_once_counted_as_dropped_and_the_stream_comes_back(
        monkeypatch, caplog):
    """A TOP larger than the bridge takes from device memory (max_frame_side a side) was refused by the bridge on
    every cook, an error each time. Now the refusal is said once per size, on the component (its size and the
    allowed most) and in the log; each cook's frame counts as dropped; an input of a size taken streams again."""
    from loom_live.plugin.touchdesigner import loom_ext

    source = HostMemoryTOP(td_texture(16, 24, seed=1))
    engine, comp, script, ext, _ = _on_cuda_ipc(monkeypatch, source)
    limit = ext.bridge.config.max_frame_side
    caplog.set_level(logging.WARNING, logger=loom_ext.__name__)
    try:
        cook_until(script, lambda: running(comp), "engine running")
        submits, refused = ext.cuda_submits, ext.bridge.stats()["refused_frames"]
        for width in (limit + 4, limit + 8):
            source.texture = td_texture(2, width, seed=width)
            dropped = comp.par.Dropped.eval()
            for _ in range(5):
                script.cook()
            assert (f"the input is {width}x2: cuda-ipc takes at most {limit} px per side (max_frame_side)"
                    in comp.par.Message.eval()), comp.par.Message.eval()
            assert comp.par.Dropped.eval() >= dropped + 5
        said = [r.getMessage() for r in caplog.records if r.name == loom_ext.__name__]
        assert [m.split(":")[0] for m in said] == [f"the input is {limit + 4}x2", f"the input is {limit + 8}x2"]
        assert ext.oversize_dropped == 10
        assert ext.cuda_submits == submits and ext.bridge.stats()["refused_frames"] == refused  # none reached it
        source.texture = texture = td_texture(16, 24, seed=2)
        cook_until(script, lambda: np.array_equal(script.output, texture), "output of an input of a size taken", 10)
        assert "cuda-ipc takes at most" not in comp.par.Message.eval()
    finally:
        ext.Stop()
        engine.stop()


@pytest.mark.parametrize("endpoint, secret", [("tcp://127.0.0.1:99999", "text"), ("tcp://127.0.0.1:port", "text"),
                                              ("tcp://[::1:5555", "text"), ("tcp://127.0.0.1:5555", "binary")])
def test_a_mistyped_remote_endpoint_or_secret_file_is_said_on_the_component(tmp_path, endpoint, secret):
    """A port out of range or not a number, a broken IPv6 address, or a Secret File that is not text (another
    file picked): Active on says what is wrong on the component, rather than raising out of the parameter
    callback with the State left at stopped and nothing said."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"s" * 32 if secret == "text" else bytes(range(128, 256)))
    secret_file.chmod(0o600)
    comp, _, ext = make_component(InputTOP(td_texture(16, 24)))
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Endpoint, comp.par.Secretfile = endpoint, str(secret_file)
    comp.parexec_enabled = True
    comp.par.Active = True  # the Parameter Execute DAT's callback: must not raise
    assert ext.bridge is None and comp.par.State.eval() == "error"
    name = "Remote Endpoint" if secret == "text" else "Secret File"
    assert comp.par.Message.eval().startswith(name), comp.par.Message.eval()


@pytest.mark.parametrize("path", ["a" * 300 + ".safetensors", "~loom-no-such-user-7/ink.safetensors"],
                         ids=["name-too-long", "home-of-nobody"])
def test_a_lora_path_the_os_cannot_look_at_is_said_and_the_engine_starts_without_it(tmp_path, path):
    """A LoRA file name longer than the OS allows, a folder the OS refuses (unreadable, an offline share), or
    a home folder of nobody: `lora_choice` refuses it like a missing file, so a LoRA page change neither
    raises out of the parameter callback nor leaves the show stopped: the engine starts without that LoRA."""
    comp, _, ext = make_component(InputTOP(td_texture(16, 24)))
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Enginepython = str(tmp_path / "python")  # no engine needed: the start is what is checked
    comp.par.Active = True
    comp.parexec_enabled = True
    comp.par.Lora1 = str(tmp_path / path) if path.startswith("a") else path  # with Active on: a restart
    try:
        assert ext.bridge is not None and ext.bridge.config.engine_args == []
        assert "LoRA 1 not loaded" in comp.par.Message.eval(), comp.par.Message.eval()
    finally:
        ext.Stop()
    assert ext.WaitClosed(10)


CALLBACK_BUDGET_S = 0.5  # a parameter callback runs on TD's main thread: every cook waits for it
# The toggling test's wall-clock bound: its engines start and stop while the other tests load the machine,
# and a 2-core box under the whole suite has held one of its cooks for 0.8 s; what it guards, no stop
# waiting on the main thread, it checks exactly by the thread each close runs on.
LOADED_STALL_BUDGET_S = 2.0


class EngineTraces:
    """What engines started from now on leave while they live: their shared-memory segments (named
    loom_<creator pid>_...) and loom threads in this process. Other tests' and other processes' are not counted."""

    def __init__(self) -> None:
        self.pids = {os.getpid()}
        self._segments = self._all_segments()
        self._threads = {t.ident for t in threading.enumerate()}

    @staticmethod
    def _all_segments() -> set[str]:
        return {p.name for p in Path("/dev/shm").glob("loom_*")} if Path("/dev/shm").is_dir() else set()

    def left(self) -> tuple[set[str], set[str]]:
        segments = {n for n in self._all_segments() - self._segments if int(n.split("_")[1]) in self.pids}
        threads = {t.name for t in threading.enumerate() if t.ident not in self._threads and t.name.startswith("loom")}
        return segments, threads


@pytest.mark.skipif(os.name == "nt", reason="the stand-in engine is a POSIX shell script")
def test_an_engine_that_refuses_its_config_shows_its_message_once_and_is_not_restarted(tmp_path):
    """An engine that exits with code 2 (missing weights, a bad config) would refuse every restart: the
    component says dead with the engine's own message, and the cook goes on with the fallback."""
    engine = exiting_engine(tmp_path, 2, "preset 'wan2.1-1.3b' needs weights that are not here")
    comp, script, ext = make_component(InputTOP(td_texture(16, 24)))
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Enginepython = str(engine)
    comp.parexec_enabled = True
    try:
        ext.Start()
        cook_until(script, lambda: comp.par.State.eval() == "dead", "engine dead")
        time.sleep(0.5)  # longer than the restart backoff: a restart would have begun by now
        script.cook()
        assert comp.par.State.eval() == "dead" and ext.bridge.status().restarts == 0
        message = comp.par.Message.eval()
        assert message == "the engine refused to start: preset 'wan2.1-1.3b' needs weights that are not here"
    finally:
        ext.Stop()


def test_setting_the_missing_engine_python_with_active_on_starts_the_engine():
    """Active turned on before Engine Python is set: the start fails saying what to set. Setting it then, with
    Active still on, starts the engine (an Engine page change restarts it, also after a start that failed)."""
    comp, script, ext = make_component(InputTOP(td_texture(16, 24)))
    comp.parexec_enabled = False
    comp.par.Transport, comp.par.Passthrough = "shm", True
    comp.parexec_enabled = True
    try:
        comp.par.Active = True
        assert comp.par.State.eval() == "error" and "set 'Engine Python'" in comp.par.Message.eval()
        comp.par.Enginepython = sys.executable
        cook_until_running(script, comp)
    finally:
        ext.Stop()


@pytest.mark.skipif(os.name == "nt", reason="the stand-in engine Python is a POSIX script")
def test_an_engine_python_without_loom_is_named_at_once_with_the_engines_last_lines(tmp_path):
    """The Engine Python has no Loom: its engine dies before it is ready. The component says so at once, in
    Message and the engine log, and does not retry it behind the user's back."""
    python = python_without_loom(tmp_path, honour_pythonpath=False)
    comp, script, ext = make_component(InputTOP(td_texture(16, 24)))
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Enginepython = str(python)
    comp.parexec_enabled = True
    try:
        ext.Start()
        cook_until(script, lambda: comp.par.State.eval() == "dead", "engine dead")
        assert ext.bridge.status().restarts == 0
        missing = ("Error while finding module specification for 'loom_live.engine' (ModuleNotFoundError: No module "
                   "named 'loom_live')")
        assert comp.par.Message.eval() == f"the engine could not start: engine exited with code 1: {python}: {missing}"
        assert missing in comp.par.Log.eval()
    finally:
        ext.Stop()


def test_toggling_active_and_pulsing_start_never_stall_the_main_thread_or_leave_engines_behind(monkeypatch):
    """Stopping an engine waits for it to exit (seconds, more while it is still starting); TD runs parameter
    callbacks on its main thread, so that wait must happen elsewhere. Afterwards nothing is left."""
    from loom_live.host_bridge import Bridge
    from loom_live.host_bridge.wire.processes import pid_alive

    closed_on = []
    close = Bridge.close

    def recording_close(bridge):
        closed_on.append(threading.current_thread() is threading.main_thread())
        close(bridge)

    monkeypatch.setattr(Bridge, "close", recording_close)
    traces = EngineTraces()
    comp, script, ext = make_component(InputTOP(td_texture(16, 24)))
    configure(comp)
    slowest = 0.0
    try:
        for i in range(4):
            for change in (lambda: setattr(comp.par, "Active", True), lambda: setattr(comp.par, "Active", False),
                           lambda: setattr(comp.par, "Active", True), comp.par.Start.pulse):
                start = time.perf_counter()
                change()
                slowest = max(slowest, time.perf_counter() - start, script.cook())
                time.sleep(0.2 * (i % 2))  # some stop while the engine process starts, some at once
            comp.par.Active = False
        comp.par.Active = True
        cook_until(script, lambda: running(comp), "engine running after the toggles")
        traces.pids.add(ext.bridge.stats()["engine_pid"])
    finally:
        start = time.perf_counter()
        comp.par.Active = False
        slowest = max(slowest, time.perf_counter() - start)
    assert slowest < LOADED_STALL_BUDGET_S, f"a callback or cook held TD's main thread for {slowest:.2f} s"
    assert ext.WaitClosed(30), "an engine did not stop"
    # each stop of a running bridge, three a round and the last; the whole suite on 2 cores once gave 14
    assert len(closed_on) >= 4 * 3 + 1, closed_on
    assert not any(closed_on), "an engine was closed on TD's main thread"
    assert not any(pid_alive(p) for p in traces.pids - {os.getpid()})
    assert wait_until(lambda: traces.left() == (set(), set()), 20), traces.left()


def test_reinitialised_extension_stops_the_old_engine_and_the_new_one_takes_over():
    """TD re-creates an extension when its DAT is edited or on Re-Init Extensions, calling the old object's
    onDestroyTD and the new one's onInitTD: the old engine must not keep running (a second engine on the
    GPU), and with Active on the show goes on with the new one."""
    from loom_live.host_bridge.wire.processes import pid_alive

    traces = EngineTraces()
    comp, script, old = make_component(InputTOP(td_texture(16, 24)))
    configure(comp)
    comp.par.Active = True
    cook_until(script, lambda: running(comp), "engine running")
    old_pid = old.bridge.stats()["engine_pid"]
    traces.pids.add(old_pid)
    old.onDestroyTD()  # what TD does on re-init
    comp.ext.LoomExt = new = LoomExt(comp)
    new.onInitTD()
    try:
        assert wait_until(lambda: not pid_alive(old_pid), 20), "the old extension's engine is still running"
        cook_until(script, lambda: running(comp), "the new extension's engine running")
        traces.pids.add(new.bridge.stats()["engine_pid"])
    finally:
        comp.par.Active = False
    assert new.WaitClosed(30) and old.WaitClosed(30)
    assert wait_until(lambda: traces.left() == (set(), set()), 20), traces.left()


def test_hot_standby_takes_over_a_killed_engine_and_the_component_shows_it():
    """Hot Standby on the Engine page keeps a second engine loaded: Standby State says when it is ready, a
    killed engine in use is replaced by it without the component leaving `running` for a restart's wait, and
    the next standby loads."""
    import signal

    comp, script, ext = make_component(InputTOP(td_texture(16, 24)))
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Hotstandby = True
    comp.parexec_enabled = True
    comp.par.Active = True
    try:
        cook_until(script, lambda: running(comp) and comp.par.Standbystate.eval() == "ready", "a standby ready")
        first, standby = ext.bridge.stats()["engine_pid"], ext.bridge.stats()["standby"]["pid"]
        os.kill(first, signal.SIGKILL)
        cook_until(script, lambda: ext.bridge.stats()["engine_pid"] == standby and running(comp),
                   "the standby in use", timeout_s=30)
        assert ext.bridge.stats()["restarts"] == 1
        cook_until(script, lambda: comp.par.Standbystate.eval() == "ready" and
                   ext.bridge.stats()["standby"]["pid"] not in (first, standby), "the next standby ready")
    finally:
        comp.par.Active = False
    assert ext.WaitClosed(30)
    assert comp.par.Standbystate.eval() == "off"
