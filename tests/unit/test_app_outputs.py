"""Spout, Syphon, virtual camera and NDI adapters against stand-ins of their bindings, and the
one-line refusals when a binding is missing.

The stand-ins follow the bindings' documented calls: SpoutGL's SpoutSender (setSenderName,
sendImage(buffer, width, height, GL_RGBA, invert, hostFBO) -> bool, setFrameSync, releaseSender),
syphon-python's SyphonMetalServer (device, publish_frame_texture, stop) with
syphon.utils.raw.create_mtl_texture / syphon.utils.numpy.copy_image_to_mtl_texture, pyvirtualcam's
Camera(width, height, fps, fmt=PixelFormat.RGB, device=...) (send, close, device), and cyndilib's
Sender / VideoSendFrame. They run on every platform; the real bindings are not tested on theirs.
"""

from __future__ import annotations

import sys
from fractions import Fraction
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

from loom_live.plugin.media.app_io import is_app_output, open_app_sink
from loom_live.plugin.media.base import MediaError
from loom_live.plugin.media.ndi import matches
from loom_live.plugin.media.sinks import open_sink
from loom_live.plugin.player.options import PlayerError, output_kind

SIZE = (32, 16)


def _frame(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (SIZE[1], SIZE[0], 3), dtype=np.uint8)


def _module(name: str, **attrs: object) -> ModuleType:
    mod = ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


# --- choosing and refusing -----------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["ndi://Loom", "NDI://Loom out", "spout://Loom", "syphon://Loom", "virtualcam",
                                  "virtualcam:///dev/video10"])
def test_app_outputs_are_recognised(spec):
    assert is_app_output(spec) and output_kind(spec) == "app"


def test_an_unknown_scheme_lists_the_app_outputs_too():
    with pytest.raises(PlayerError, match=r"ndi://, spout://, syphon://, 'virtualcam'"):
        output_kind("obs://Loom")


def test_an_output_without_a_name_is_refused():
    with pytest.raises(MediaError, match=r"give a name after ndi://"):
        open_app_sink("ndi://  ", 30.0, SIZE)


@pytest.mark.parametrize("spec, module, extra", [("ndi://Loom", "cyndilib", "ndi"),
                                                 ("virtualcam", "pyvirtualcam", "virtualcam")])
def test_a_missing_binding_says_what_to_install_in_one_line(monkeypatch, spec, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(MediaError) as err:
        open_sink(spec, 30.0, SIZE)
    assert f"pip install 'loom-live[{extra}]'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("spec, platform, needs", [("spout://Loom", "linux", "Windows"),
                                                   ("syphon://Loom", "win32", "macOS")])
def test_a_texture_share_on_another_platform_is_refused(monkeypatch, spec, platform, needs):
    monkeypatch.setattr(sys, "platform", platform)
    with pytest.raises(MediaError, match=f"exists only on {needs}"):
        open_sink(spec, 30.0, SIZE)


def test_missing_ndi_input_says_what_to_install(monkeypatch):
    from loom_live.plugin.media.sources import open_source

    monkeypatch.setitem(sys.modules, "cyndilib", None)
    with pytest.raises(MediaError, match=r"pip install 'loom-live\[ndi\]'"):
        open_source("ndi://Studio (Camera 1)")


def test_list_ndi_without_cyndilib_is_one_line_and_exit_code_2(monkeypatch, capsys):
    from loom_live.plugin.cli.play import _list_ndi

    monkeypatch.setitem(sys.modules, "cyndilib", None)
    assert _list_ndi() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "loom-live[ndi]" in err and "Traceback" not in err


@pytest.mark.parametrize("wanted, ok", [("Loom", True), ("studio-pc (loom)", True), ("Lo", False),
                                         ("STUDIO-PC", False)])
def test_ndi_sources_match_by_full_or_stream_name(wanted, ok):
    assert matches(wanted, "STUDIO-PC (Loom)") is ok


# --- Spout -------------------------------------------------------------------------------------

class FakeSpoutSender:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.accept = True

    def setSenderName(self, name: str) -> None:
        self.calls.append(("name", name))

    def sendImage(self, buffer, width, height, gl_format, invert, host_fbo) -> bool:
        self.calls.append(("image", np.array(buffer), width, height, gl_format, invert, host_fbo))
        return self.accept

    def setFrameSync(self, name: str) -> None:
        self.calls.append(("sync", name))

    def releaseSender(self) -> None:
        self.calls.append(("release",))


@pytest.fixture
def spout(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    senders: list[FakeSpoutSender] = []

    def make() -> FakeSpoutSender:
        senders.append(FakeSpoutSender())
        return senders[-1]

    monkeypatch.setitem(sys.modules, "SpoutGL", _module("SpoutGL", SpoutSender=make))
    return senders


def test_spout_sends_opaque_rgba_top_row_first_and_signals_each_frame(spout):
    sink = open_sink("spout://Loom Out", 30.0, SIZE)
    frame = _frame()
    sink.write(frame)
    sink.close()
    calls = spout[0].calls
    assert calls[0] == ("name", "Loom Out")
    _, rgba, w, h, gl_format, invert, fbo = calls[1]
    assert (w, h, gl_format, invert, fbo) == (*SIZE, 0x1908, False, 0)
    assert rgba.shape == (SIZE[1], SIZE[0], 4) and (rgba[..., :3] == frame).all() and (rgba[..., 3] == 255).all()
    assert calls[2:] == [("sync", "Loom Out"), ("release",)]
    assert sink.kept and sink.is_network


def test_spout_refusing_a_frame_is_an_output_error(spout):
    sink = open_sink("spout://Loom", 30.0, SIZE)
    spout[0].accept = False
    with pytest.raises(MediaError, match="spout://Loom: sending failed: sendImage failed"):
        sink.write(_frame())


def test_a_frame_of_the_wrong_shape_is_refused_before_the_binding(spout):
    sink = open_sink("spout://Loom", 30.0, SIZE)
    with pytest.raises(MediaError, match=r"uint8 \(16, 32, 3\) RGB"):
        sink.write(np.zeros((16, 32, 4), np.uint8))
    assert [c[0] for c in spout[0].calls] == ["name"]


# --- Syphon ------------------------------------------------------------------------------------

@pytest.fixture
def syphon(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    log: list[tuple] = []

    class Server:
        def __init__(self, name: str) -> None:
            log.append(("server", name))
            self.device = "metal-device"

        def publish_frame_texture(self, texture) -> None:
            log.append(("publish", texture["pixels"].copy()))

        def stop(self) -> None:
            log.append(("stop",))

    def create_mtl_texture(device, width, height):
        log.append(("texture", device, width, height))
        return {"pixels": None}

    def copy_image_to_mtl_texture(image, texture) -> None:
        texture["pixels"] = np.array(image)

    utils = _module("syphon.utils")
    modules = {"syphon": _module("syphon", SyphonMetalServer=Server, utils=utils), "syphon.utils": utils,
               "syphon.utils.numpy": _module("syphon.utils.numpy", copy_image_to_mtl_texture=copy_image_to_mtl_texture),
               "syphon.utils.raw": _module("syphon.utils.raw", create_mtl_texture=create_mtl_texture)}
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return log


def test_syphon_publishes_one_opaque_rgba_texture_per_frame(syphon):
    sink = open_sink("syphon://Loom", 25.0, SIZE)
    frames = [_frame(1), _frame(2)]
    for frame in frames:
        sink.write(frame)
    sink.close()
    assert syphon[:2] == [("server", "Loom"), ("texture", "metal-device", *SIZE)]
    published = [entry[1] for entry in syphon if entry[0] == "publish"]
    assert len(published) == 2 and syphon[-1] == ("stop",)
    for rgba, frame in zip(published, frames):
        assert (rgba[..., :3] == frame).all() and (rgba[..., 3] == 255).all()


# --- virtual camera ----------------------------------------------------------------------------

def _pyvirtualcam(fail: str = "") -> tuple[ModuleType, list]:
    cams: list = []

    class Camera:
        def __init__(self, width, height, fps, *, fmt, device=None):
            if fail:
                raise RuntimeError(fail)
            self.args, self.sent, self.closed = (width, height, fps, fmt, device), [], False
            self.device = device or "/dev/video7"
            cams.append(self)

        def send(self, frame):
            self.sent.append(frame.copy())

        def close(self):
            self.closed = True

    return _module("pyvirtualcam", Camera=Camera, PixelFormat=SimpleNamespace(RGB="RGB")), cams


def test_virtualcam_gets_rgb_frames_at_the_run_rate(monkeypatch):
    module, cams = _pyvirtualcam()
    monkeypatch.setitem(sys.modules, "pyvirtualcam", module)
    sink = open_sink("virtualcam", 24.0, SIZE)
    frame = _frame()
    sink.write(frame)
    sink.close()
    (cam,) = cams
    assert cam.args == (*SIZE, 24.0, "RGB", None) and cam.closed
    assert len(cam.sent) == 1 and (cam.sent[0] == frame).all()
    assert sink.name == "virtualcam (/dev/video7)"


def test_virtualcam_device_is_passed_on(monkeypatch):
    module, cams = _pyvirtualcam()
    monkeypatch.setitem(sys.modules, "pyvirtualcam", module)
    open_sink("virtualcam:///dev/video10", 24.0, SIZE)
    assert cams[0].args[-1] == "/dev/video10"


def test_no_virtual_camera_is_one_line_with_what_makes_one(monkeypatch):
    module, _ = _pyvirtualcam("'v4l2loopback' backend: no v4l2 loopback device found\n")
    monkeypatch.setitem(sys.modules, "pyvirtualcam", module)
    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(MediaError) as err:
        open_sink("virtualcam", 24.0, SIZE)
    assert "no v4l2 loopback device found" in str(err.value) and "modprobe v4l2loopback" in str(err.value)
    assert "\n" not in str(err.value)


# --- NDI sender (the real runtime is in tests/integration/test_ndi_loopback.py) --------------------

def test_ndi_sender_sends_bgra_at_an_ndi_frame_rate(monkeypatch):
    sent: list = []

    class VideoSendFrame:
        def set_resolution(self, w, h):
            self.resolution = (w, h)

        def set_fourcc(self, fourcc):
            self.fourcc = fourcc

        def set_frame_rate(self, rate):
            self.rate = rate

    class Sender:
        def __init__(self, name, clock_video):
            self.name, self.clock_video = name, clock_video

        def set_video_frame(self, frame):
            self.frame = frame

        def open(self):
            sent.append(self)

        def write_video(self, data):
            sent.append(np.array(data))
            return True

        def close(self):
            sent.append("closed")

    fake = _module("cyndilib", Sender=Sender, VideoSendFrame=VideoSendFrame, FourCC=SimpleNamespace(BGRA="BGRA"))
    monkeypatch.setitem(sys.modules, "cyndilib", fake)
    sink = open_sink("ndi://Loom", 30000 / 1001, SIZE)
    frame = _frame()
    sink.write(frame)
    sink.close()
    sender, data, closed = sent
    assert sender.name == "Loom" and sender.clock_video and closed == "closed"
    assert sender.frame.resolution == SIZE and sender.frame.fourcc == "BGRA"
    assert sender.frame.rate == Fraction(30000, 1001)
    bgra = data.reshape(SIZE[1], SIZE[0], 4)
    assert (bgra[..., 2::-1] == frame).all() and (bgra[..., 3] == 255).all()
