"""Issue 24: what a 60 FPS show in real TouchDesigner needs from the Loom operator, against a stand-in
that follows derivative.ca's documentation (tests/fakes/touchdesigner.py) rather than the operator.

Each test names the point of the issue it covers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loom_live.host_bridge import launcher
from loom_live.host_bridge.bridge_stats import BridgeStatus
from loom_live.plugin.touchdesigner import loom_ext
from loom_live.plugin.touchdesigner.build_loom import CALLBACKS_DAT, EXTENSION, build
from loom_live.plugin.touchdesigner.loom_ext import PAREXEC_PARS, STATUS_PARS, LoomExt
from loom_live.plugin.touchdesigner.parameters import PARAMETERS
from tests.fakes.touchdesigner import (
    InputTOP,
    NetworkCOMP,
    StandInDeviceBuffer,
    TDError,
    Timeline,
    configure,
    cook_until,
    cook_until_running,
    fake_td_module,
    make_component,
    running,
    start_device_bridge,
    td_texture,
)

HERE = Path(loom_ext.__file__).parent


class StubBridge:
    """A bridge that never runs an engine: its status changes every call, as a running one's does."""

    config = SimpleNamespace(transport="shm")

    def __init__(self):
        self.calls, self.closed, self.wanted = 0, False, None

    def submit(self, frame, layout="rgb", control=None):
        return True

    def engine_report(self, refresh=False):
        return {}  # no engine has reported yet

    def latest(self):
        self.calls += 1
        return None, BridgeStatus(state="running", fps=30.0 + self.calls, latency_ms=10.0 + self.calls,
                                  dropped=self.calls, message="", log_tail=[f"line {self.calls}"])

    def status(self):
        return self.latest()[1]

    def close(self):
        self.closed = True


# --- 1. an input cudaMemory refuses -------------------------------------------------------------


def test_a_16bit_float_input_that_cudamemory_refuses_streams_through_the_cpu():
    rgba = td_texture(24, 32, np.float32, seed=2).astype(np.float16)  # rgba16float
    source = InputTOP(rgba)
    with pytest.raises(TDError, match="16-bit float"):
        source.cudaMemory()  # the stand-in refuses as TD 2025 does
    comp, script, ext = make_component(source)
    start_device_bridge(comp, ext)
    try:
        cook_until_running(script, comp)
        cook_until(script, lambda: ext.bridge.stats()["received"] >= 3, "outputs of the fp16 input")
        assert ext.numpy_submits > 0 and ext.cuda_submits == 0
        assert script.output is not None and script.output.shape == (24, 32, 3)  # the engine's frame, not frozen
        assert "cudaMemory() refused" in comp.par.Message.eval()
    finally:
        ext.Stop()


# --- 2. cook on demand ---------------------------------------------------------------------------


def test_the_stand_in_cooks_only_on_request():
    comp, script, _ = make_component(InputTOP(td_texture(4, 4)))
    timeline = Timeline(comp, script)
    for _ in range(3):
        timeline.step()
    assert script.cooks == 0  # nothing views it
    script.viewed = True
    timeline.step()
    timeline.step()
    assert script.cooks == 1  # viewed, but a still input gives no reason to cook again
    script.inputs[0].set(td_texture(4, 4, seed=1))
    timeline.step()
    assert script.cooks == 2


def test_engine_frames_show_with_a_still_input_and_nothing_viewing_the_output():
    comp, script, ext = make_component(InputTOP(td_texture(16, 24, seed=4)))
    dat = SimpleNamespace(parent=lambda: comp)
    namespace = {"me": dat}
    exec((HERE / "execute_callbacks.py").read_text(), namespace)  # the Execute DAT's text, `me` set by TD
    timeline = Timeline(comp, script)
    timeline.execute_dats.append(SimpleNamespace(onFrameStart=namespace["onFrameStart"]))
    timeline.step()
    assert script.cooks == 0  # inactive: nothing forces a cook
    configure(comp)
    comp.par.Active = True
    try:
        deadline = time.monotonic() + 60
        while not running(comp) or ext.bridge.stats()["received"] < 3:
            assert time.monotonic() < deadline, comp.par.Message.eval()
            timeline.step()
            time.sleep(0.02)
        assert script.cooks == timeline.frame - 1  # one cook per frame while active
        assert script.output is not None and script.output.shape == (16, 24, 3)
        script.viewed = True  # now a viewer asks each frame, for a new input each frame: nothing is forced
        timeline.step(td_texture(16, 24, seed=5))  # the frame after the last forced one
        cooks = script.cooks
        for seed in range(10):
            timeline.step(td_texture(16, 24, seed=seed))
        assert script.cooks == cooks + 10  # one cook per frame, not two
        script.viewed = False  # the viewer closes: forced cooks again, from the next frame
        for _ in range(3):
            timeline.step()
        assert script.cooks == cooks + 10 + 2
    finally:
        comp.par.Active = False


# --- 3. copyNumpyArray channel order ------------------------------------------------------------


def test_a_pure_red_frame_stays_red_through_copy_numpy_array():
    red = np.zeros((20, 28, 4), np.uint8)
    red[..., 2] = red[..., 3] = 255  # uint8 texture in memory: BGRA, so this is pure red
    comp, script, ext = make_component(InputTOP(red))
    configure(comp)
    comp.par.Active = True
    try:
        cook_until_running(script, comp)
        cook_until(script, lambda: ext.bridge.stats()["received"] >= 3, "outputs")
        out = script.output
        assert out.dtype == np.uint8 and out.shape[2] in (3, 4)
        assert (out[..., 0] == 255).all() and (out[..., 1] == 0).all() and (out[..., 2] == 0).all()  # R, G, B
    finally:
        comp.par.Active = False


# --- 4. __delTD__ only ---------------------------------------------------------------------------


def test_a_build_that_calls_only_del_td_still_stops_the_engine():
    comp, _, ext = make_component(InputTOP(td_texture(4, 4)))
    stub = ext.bridge = StubBridge()
    ext.__delTD__()
    assert ext.WaitClosed(5) and stub.closed and ext.bridge is None


# --- 5. main-thread cost ----------------------------------------------------------------------


def test_one_cuda_stream_reaches_cudamemory_the_bridge_and_copycudamemory():
    source = InputTOP(td_texture(16, 24, seed=6))
    comp, script, ext = make_component(source)
    start_device_bridge(comp, ext)
    try:
        cook_until_running(script, comp)
        stream = StandInDeviceBuffer.STREAM
        assert set(source.cuda_streams) == {stream}
        assert {kind for kind, _ in ext.bridge.streams} == {"submit_cuda", "latest_cuda"}
        assert {s for _, s in ext.bridge.streams} == {stream}
        assert set(script.cuda_streams) == {stream}
    finally:
        ext.Stop()


def test_the_host_path_reads_the_input_without_stalling_the_gpu():
    source = InputTOP(td_texture(8, 8))
    comp, script, ext = make_component(source)
    ext.bridge = StubBridge()
    for _ in range(3):
        script.cook()
    assert source.numpy_calls == [True, True, True]  # delayed: the last cook's download
    ext.bridge = None


def test_an_inactive_component_touches_neither_the_input_nor_the_output():
    source = InputTOP(td_texture(8, 8))
    comp, script, ext = make_component(source)
    for _ in range(3):
        script.cook()
    assert source.numpy_calls == [] and source.cuda_streams == [] and script.output is None


# --- 6. CUDA work on the host's thread -----------------------------------------------------------


def test_cuda_ipc_output_copies_run_on_the_hosts_thread_not_the_bridges(monkeypatch):
    pytest.importorskip("cuda.bindings.runtime", reason="the cuda-ipc ring code needs cuda-python (no GPU)")
    from loom_live.engine.server.passthrough import PassthroughSession
    from loom_live.host_bridge import Bridge, BridgeConfig
    from loom_live.host_bridge.wire.rings import cuda as tc
    from tests.fakes.cuda_runtime import FakeRuntime
    from tests.fakes.engines import InProcessEngine

    rt = FakeRuntime()
    copies = []
    plain = rt.cudaMemcpy2DAsync

    def recording(dst, dpitch, src, spitch, width, height, kind, stream):
        copies.append((threading.current_thread().name, dst, src))
        return plain(dst, dpitch, src, spitch, width, height, kind, stream)

    rt.cudaMemcpy2DAsync = recording
    monkeypatch.setattr(tc, "cudart", rt)
    with InProcessEngine(PassthroughSession) as engine:
        cfg = BridgeConfig(transport="cuda-ipc", **engine.host, heartbeat_s=0.05,
                           hang_timeout_s=1.0)
        with Bridge(cfg) as bridge:
            bridge.wait_running(10)
            frame = np.random.default_rng(1).integers(0, 256, (6, 10, 4), dtype=np.uint8)
            back = np.zeros_like(frame)
            for _ in range(5):
                bridge.submit_cuda(frame.ctypes.data, frame.strides[0], 10, 6, 4, "uint8", layout="touchdesigner")
                time.sleep(0.2)  # the bridge's thread ticks meanwhile; outputs wait for the host
                bridge.latest_cuda(back.ctypes.data, back.strides[0])
            assert np.array_equal(back, frame)
            outputs = set(bridge._sup.link.ring_out.ptrs) | set(bridge._frames.output_device.ptrs)
    on_bridge_thread = [c for c in copies if c[0] == "loom-bridge" and (c[1] in outputs or c[2] in outputs)]
    assert on_bridge_thread == []


# --- 7. status parameters and the Parameter Execute DAT ------------------------------------------


def test_the_stand_in_fires_for_read_only_parameters_and_refuses_help():
    comp, _, _ = make_component(None)  # setup_parameters ran although `help` is read-only
    with pytest.raises(TDError, match="read-only"):
        comp.par.Fps.help = "frames per second"
    comp.parexec_pars = "*"
    comp.ext.LoomExt.bridge = None
    comp.par.Fps = 12.5
    assert comp.parexec_fired == ["Fps"]  # read-only stops the user, not the callback


def test_status_written_each_cook_never_fires_the_parameter_execute_dat():
    comp, script, ext = make_component(InputTOP(td_texture(8, 8)))
    assert set(PAREXEC_PARS.split()) == {p.name for p in PARAMETERS} - set(STATUS_PARS)
    ext.bridge = StubBridge()
    for _ in range(5):
        script.cook()
    assert comp.par.Fps.eval() == 35.0 and comp.parexec_fired == []
    ext.bridge = None


# --- 8. the build script -------------------------------------------------------------------------


def test_the_build_script_creates_a_working_component_in_a_network():
    td = fake_td_module()
    project = NetworkCOMP()
    comp = build(project, td_module=td)
    kinds = {name: node.OPType for name, node in comp.children.items()}
    assert kinds == {"loom_ext": "textDAT", "loom_callbacks": "textDAT", "in1": "inTOP", "in2": "inTOP",
                     "loom_top": "scriptTOP",
                     "loom_top_callbacks": "textDAT", "loom_switch": "switchTOP", "out1": "outTOP",
                     "loom_parexec": "parameterexecuteDAT", "loom_frames": "executeDAT"}
    script = comp.op("loom_top")
    assert script.par.callbacks.eval() == CALLBACKS_DAT and script.inputs == [comp.op("in1"), comp.op("in2")]
    assert callable(comp.op(CALLBACKS_DAT).module.onCook)
    parexec = comp.op("loom_parexec")
    assert parexec.par.pars.eval() == PAREXEC_PARS and parexec.par.op.eval() == ".."
    assert parexec.par.valuechange.eval() and parexec.par.onpulse.eval()
    assert callable(parexec.module.onValueChange) and callable(comp.op("loom_frames").module.onFrameStart)
    assert comp.op("loom_frames").par.framestart.eval()
    switch = comp.op("loom_switch")
    assert switch.inputs == [comp.op("in1"), script] and comp.op("out1").inputs == [switch]
    index = lambda: eval(switch.par.index.expr, {"parent": lambda: comp})  # noqa: E731
    assert {p.name for p in PARAMETERS} <= set(comp.par._pars)
    assert index() == 0  # inactive: the input
    comp.parexec_enabled = False
    comp.par.Active = True
    assert index() == 1
    assert [p.name for p in comp.customPages] == ["Loom", "Engine", "LoRA", "Control", "Status"]
    assert comp.par.extension1.eval() == EXTENSION and comp.par.promoteextension1.eval() is True
    ext = eval(EXTENSION, {"op": comp.op, "me": comp})
    assert isinstance(ext, LoomExt) and ext.ownerComp is comp
    with pytest.raises(ValueError, match="already exists"):
        build(project, td_module=td)  # never replaces what a user has


# --- 9. Windows launch -------------------------------------------------------------------------


def test_windows_launch_has_no_console_window_and_a_group_of_its_own():
    flags = launcher.popen_options("nt")["creationflags"]
    assert flags & launcher.CREATE_NO_WINDOW and flags & launcher.CREATE_NEW_PROCESS_GROUP
    assert launcher.popen_options("posix") == {"start_new_session": True}


def test_a_windows_stop_reaches_the_tree_without_ctrl_break():
    runs = []
    proc = SimpleNamespace(pid=4242, poll=lambda: None,
                           send_signal=lambda sig: pytest.fail("Ctrl-Break needs a console the engine lacks"))
    launcher._signal_tree(proc, kill=False, os_name="nt", run=lambda argv, **kw: runs.append(argv))
    launcher._signal_tree(proc, kill=True, os_name="nt", run=lambda argv, **kw: runs.append(argv))
    assert runs == [["taskkill", "/T", "/PID", "4242"], ["taskkill", "/F", "/T", "/PID", "4242"]]


def test_the_cook_leaves_converting_the_host_frame_to_a_feeder_thread():
    from loom_live.plugin.touchdesigner.host_feeder import HostFeeder

    release, threads, taken = threading.Event(), [], []

    class SlowBridge:
        def submit(self, frame, layout="rgb", control=None):
            threads.append(threading.current_thread().name)
            release.wait(5)  # a conversion that outlasts a frame
            if frame is None:
                raise ValueError("frame: None is not an array")
            taken.append(int(frame[0, 0, 0]))

    feeder = HostFeeder(SlowBridge())
    for i in range(4):  # the main thread never waits on the conversion
        feeder.offer(np.full((2, 2, 4), i, np.float32))
    release.set()
    deadline = time.monotonic() + 5
    while taken[-1:] != [3] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threads) == {"loom-td-feeder"} and taken[-1] == 3 and feeder.replaced >= 1
    feeder.close()


def test_a_build_whose_cuda_methods_take_no_stream_still_streams_device_to_device():
    class OldTOP(InputTOP):
        def cudaMemory(self):  # no stream keyword
            return super().cudaMemory()

    source = OldTOP(td_texture(16, 24, seed=8))
    comp, script, ext = make_component(source)

    def old_copy(address, size, shape):
        type(script).copyCUDAMemory(script, address, size, shape)

    script.copyCUDAMemory = old_copy
    start_device_bridge(comp, ext)
    try:
        cook_until_running(script, comp)
        cook_until(script, lambda: script.output is not None and np.array_equal(script.output, source.texture),
                   "the input back through the device path")
        assert ext.cuda_submits > 0 and ext.numpy_submits == 0
    finally:
        ext.Stop()
