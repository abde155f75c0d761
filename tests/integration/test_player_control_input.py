"""`loom play --control-input SOURCE`: a second input sent as the VACE control video of each frame, through a
real engine process whose pass-through session records the control frames it gets; a control input that
ends or fails is said once and the frames go on with the engine's grey control (counted)."""

from __future__ import annotations

import threading

import cv2
import numpy as np
import pytest

from loom_live.plugin.cli.main import main
from loom_live.plugin.media.generated_clip import generate_clip
from loom_live.plugin.media.sources import open_source
from loom_live.plugin.player.app import Player
from loom_live.plugin.player.control_input import GENERATED_SEED_OFFSET, ControlInput
from loom_live.plugin.player.options import PlayerOptions
from tests.fakes.media import write_clip

SIZE = (64, 48)  # the output's (width, height)


def play_recording(monkeypatch, **options) -> tuple[Player, int, dict]:
    """Run a pass-through player (a VACE config, the video control source) and take what its engine's session
    recorded just before the run closes the engine."""
    report: dict = {}
    close = Player._close

    def recording_close(self, keep, stopping):
        if self.bridge is not None:
            self.bridge.set_params(noise_scale=0.5, wait=True)  # answered after every frame before it
            report.update(self.bridge.engine_report(refresh=True)["session"]["control"])
        close(self, keep, stopping)

    monkeypatch.setattr(Player, "_close", recording_close)
    player = Player(PlayerOptions(config="tiny-vace", overrides=["control.control_source=video"], passthrough=True,
                                  size=SIZE, **{"quiet": True, **options}))
    return player, player.run(), report


def test_a_control_file_goes_frame_locked_with_the_input_scaled_and_its_end_is_said_once(tmp_path, monkeypatch,
                                                                                         capsys):
    rng = np.random.default_rng(0)
    control = write_clip(tmp_path / "control.mp4", [rng.integers(0, 256, (40, 48, 3), np.uint8) for _ in range(5)])
    with open_source(str(control)) as source:  # what the player reads: the same decoder, the same frames
        want = [cv2.resize(f, SIZE, interpolation=cv2.INTER_AREA) for f in source]
    player, code, report = play_recording(monkeypatch, max_frames=8, control_input=str(control),
                                          outputs=[str(tmp_path / "out.mp4")], quiet=False)
    err = capsys.readouterr().err
    assert code == 0, err
    assert report["frames"] == 5 and report["missing"] == 3  # frames 0..4 with theirs, 5..7 with the grey
    assert report["sum"] == sum(int(f.astype(np.int64).sum()) for f in want)
    assert err.count("control input 48x40 scaled to the output's 64x48") == 1
    assert err.count("it ended after 5 frames; the frames go on with the engine's grey control") == 1
    assert "control frames: 5 sent, 3 without (grey)" in err


def test_the_generated_clip_as_the_control_of_a_live_run(tmp_path, monkeypatch):
    """Live: each submitted frame carries the control frame read with it; the run is quit once the engine
    has taken a few (latest wins, so it may skip some of the frames sent)."""
    stop = threading.Event()
    start = Player.run

    def run_until_controls_arrive(self):
        def watch():
            while not stop.wait(0.05):
                report = (self.bridge.engine_report() if self.bridge is not None else {}).get("session") or {}
                if report.get("control", {}).get("frames", 0) >= 3:
                    self.controls.state.quit = True
                    return

        threading.Thread(target=watch, daemon=True).start()
        return start(self)

    monkeypatch.setattr(Player, "run", run_until_controls_arrive)
    try:
        player, code, report = play_recording(monkeypatch, max_frames=10**6, mode="live", control_input="generated",
                                              outputs=[str(tmp_path / "out.mp4")])
    finally:
        stop.set()
    assert code == 0
    sent = player.control_input.sent
    assert sent == player.frames_in and player.control_input.missing == 0
    assert 3 <= report["frames"] <= sent and report["missing"] == 0
    clip = generate_clip(sent, size=SIZE, fps=24.0, seed=GENERATED_SEED_OFFSET)
    sums = [int(f.astype(np.int64).sum()) for f in clip]  # the engine got some of these, each once at most
    assert sum(sorted(sums)[:report["frames"]]) <= report["sum"] <= sum(sorted(sums)[-report["frames"]:])


class FailingCamera:
    """A live source that gives `frames` frames, then fails like an unplugged camera."""

    is_live = True
    name = "camera 7"

    def __init__(self, frames: int, shape: tuple[int, int, int]) -> None:
        self.left = frames
        self.shape = shape
        self.closed = threading.Event()
        self.read_again = threading.Event()

    def read(self) -> np.ndarray:
        if self.left == 0:
            self.read_again.set()
            raise OSError("device unplugged")
        self.left -= 1
        return np.full(self.shape, 9, np.uint8)

    def close(self) -> None:
        self.closed.set()


def test_a_live_control_input_that_fails_is_said_once_and_the_frames_go_on_without_it():
    said: list[str] = []
    camera = FailingCamera(3, (48, 64, 3))
    control = ControlInput(camera, SIZE, said.append)
    assert camera.read_again.wait(10) and camera.closed.wait(10)  # its thread read on, failed and closed it
    frames = [control.next() for _ in range(4)]
    assert all(f is None for f in frames) and control.missing == 4 and control.sent == 0
    assert said == ["control input camera 7: it failed (device unplugged) after 0 frames; the frames go on with "
                    "the engine's grey control"]
    control.close()


def test_a_live_control_input_gives_its_newest_frame_to_every_main_frame():
    said: list[str] = []
    camera = FailingCamera(10**9, (49, 65, 3))  # odd sides: the last row and column dropped, as the input's
    control = ControlInput(camera, SIZE, said.append)
    try:
        while (frame := control.next()) is None:
            pass
        assert frame.shape == (48, 64, 3) and (frame == 9).all() and said == []
    finally:
        control.close()
    assert camera.closed.wait(10)


@pytest.mark.parametrize("args, expected", [
    (["--control", "edges", "--control-input", "generated", "-c", "tiny-vace"],
     "--control and --control-input both name the control video"),
    (["--control-input", "generated", "-c", "tiny-random"],
     "--control, --control-input and --reference steer a VACE model"),
    (["--control-input", "generated"], "control.control_source=video: model preset 'embedded' takes only its input's "
                                       "edges"),
    (["--control", "grey"], "control.control_source=grey: model preset 'embedded' takes only its input's edges"),
    (["--reference", "look.png"], "model preset 'embedded' takes only its input's edges"),
    (["--control-input", "/no/such/control.mp4", "-c", "tiny-vace", "--passthrough"], "--control-input: "),
])
def test_bad_control_inputs_end_with_one_line(tmp_path, capsys, monkeypatch, args, expected):
    monkeypatch.chdir(tmp_path)
    code = main(["play", "-n", "3", "--size", "32x32", "-o", str(tmp_path / "o.mp4"), *args])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err
