"""`loom play` end to end, as a user runs it: `python -m loom_live.plugin.cli play ...` in a real process.

Engine runs use few, small frames to stay inside the CPU test budget. `--passthrough` runs make the
content exact (the engine returns its input), so the plumbing is checked pixel for pixel; the
default runs use the embedded model, as a user's first `loom play` does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loom_live.host_bridge.wire.cpu_awake import CpuAwake
from loom_live.host_bridge.wire.params import steps_for
from loom_live.plugin.cli.main import main
from loom_live.plugin.media.partial_files import partial_path
from loom_live.plugin.player.controls import Command, ControlError, Controls, ControlState, KeyboardInput, steps_command
from loom_live.plugin.player.osc import OSC_ADDRESSES, command_for
from tests.fakes.engines import ConfigSessions, InProcessEngine, exiting_engine, python_without_loom, wait_until
from tests.fakes.media import damage_middle, free_udp_port, noise_clip, rtmp_server, write_clip

ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120


def _play(*args: str, cwd: Path | None = None, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "play", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT, env=env)


def _decode(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)





# --- end to end ----------------------------------------------------------------------------------


def test_no_arguments_writes_loom_out_mp4_with_the_embedded_model(tmp_path):
    """The README's first command: no input, no output given -> ./loom_out.mp4 from the generated clip."""
    out = _play("-n", "17", cwd=tmp_path)  # -n keeps the CPU run short; everything else is the default
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    frames = _decode(tmp_path / "loom_out.mp4")
    assert frames.shape == (17, 256, 256, 3)


def test_real_clip_through_the_embedded_model(media_dir, tmp_path):
    src = media_dir / "davis512_blackswan.mp4"
    dst = tmp_path / "styled.mp4"
    out = _play("-i", str(src), "-o", str(dst), "-n", "17")
    assert out.returncode == 0, out.stderr
    frames = _decode(dst)
    assert frames.shape == (17, 512, 512, 3)
    original = _decode_first(src, 17)
    assert _psnr(frames, original) < 40, "the model should change the picture"


def _decode_first(path: Path, n: int) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        frames = []
        for f in container.decode(video=0):
            frames.append(f.to_ndarray(format="rgb24"))
            if len(frames) == n:
                break
    return np.stack(frames)


def test_real_clip_passthrough_keeps_every_frame_in_order(media_dir, tmp_path):
    src = media_dir / "davis512_parkour.mp4"
    dst = tmp_path / "through.mkv"
    out = _play("-i", str(src), "-o", str(dst), "-n", "21", "--passthrough")
    assert out.returncode == 0, out.stderr
    got = _decode(dst)
    want = _decode_first(src, 21)
    assert got.shape == want.shape == (21, 512, 512, 3)
    # H.264 twice (the source and our output) but the same frames in the same order: high PSNR per
    # frame, and each output frame is closest to its own input frame (a shift would break this).
    small_got, small_want = got[:, ::4, ::4], want[:, ::4, ::4]  # subsampled: 21x21 comparisons stay cheap
    for i in range(len(got)):
        scores = [_psnr(small_got[i], small_want[j]) for j in range(len(want))]
        assert int(np.argmax(scores)) == i
        assert _psnr(got[i], want[i]) > 30


def test_generated_clip_passthrough_frame_count_and_size(tmp_path):
    dst = tmp_path / "gen.mp4"
    out = _play("-n", "25", "--size", "96x64", "-o", str(dst), "--passthrough")
    assert out.returncode == 0, out.stderr
    frames = _decode(dst)
    assert frames.shape == (25, 64, 96, 3)
    assert "25/25 frames" in out.stderr or "25 frames" in out.stderr


MIN_UDP_FRAMES = 20  # of 25 sent: UDP may lose a few on a busy machine


def test_udp_output_is_readable_by_a_pyav_client(tmp_path):
    import av

    port = free_udp_port()
    received: list[np.ndarray] = []
    ready = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            # PyAV (FFmpeg) listens on the port. The first frame comes only once the engine runs, which
            # takes seconds on a loaded box (a 2 s timeout failed there), so the timeout is generous, and
            # the read stops once the 20 frames asked for below are in: the last one or two are handed
            # out only at the end of the stream, i.e. with the timeout.
            with av.open(f"udp://127.0.0.1:{port}?timeout=10000000", format="mpegts", timeout=(30, 10)) as c:
                for frame in c.decode(video=0):
                    received.append(frame.to_ndarray(format="rgb24"))
                    if len(received) == MIN_UDP_FRAMES:
                        return
        except Exception as exc:  # end of stream shows up as a timeout error
            if not received:
                errors.append(exc)

    def open_then_signal() -> None:
        ready.set()
        reader()

    t = threading.Thread(target=open_then_signal, daemon=True)
    t.start()
    ready.wait()
    time.sleep(0.5)  # let FFmpeg bind the port before the player sends
    out = _play("-n", "25", "--size", "128x96", "-o", f"udp://127.0.0.1:{port}", "--passthrough", "--fps", "25")
    assert out.returncode == 0, out.stderr
    t.join(timeout=60)
    assert not errors, errors
    assert len(received) >= MIN_UDP_FRAMES, f"only {len(received)} of 25 frames arrived over UDP"
    assert received[0].shape == (96, 128, 3)


def _file_run(dst: Path, frames: int, size: str, stdout: int = subprocess.PIPE) -> subprocess.Popen:
    """`loom play` of the generated clip into `dst` on the pass-through engine, in a process of its own."""
    return subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "play", "-n", str(frames), "--size", size,
                             "-o", str(dst), "--passthrough"], stdout=stdout, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def _wait_writing(proc: subprocess.Popen, dst: Path, nbytes: int) -> None:
    """Until the run has written `nbytes` of `dst` (under its partial name until finalised), for at most 90 s."""
    deadline = time.monotonic() + 90
    partial = partial_path(dst)
    while time.monotonic() < deadline and (not partial.exists() or partial.stat().st_size < nbytes):
        time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1]


def test_ctrl_c_stops_cleanly_and_finalises_the_file(tmp_path):
    dst = tmp_path / "stopped.mp4"
    proc = _file_run(dst, 100000, "64x64")
    try:
        _wait_writing(proc, dst, 20_000)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "stopped by Ctrl-C" in err
    frames = _decode(dst)  # a finalised file: the trailer is there and every frame decodes
    assert len(frames) > 0 and frames.shape[1:] == (64, 64, 3)


def test_ctrl_c_through_a_pipe_to_tee_still_finalises_the_file(tmp_path):
    """`loom play ... 2>&1 | tee show.log`: Ctrl-C stops tee as well, so the player's last lines meet a
    broken pipe. The recording must still be finalised and put in place, and the run end with 130."""
    dst = tmp_path / "set.mp4"
    proc = _file_run(dst, 100000, "32x32", stdout=subprocess.DEVNULL)
    try:
        _wait_writing(proc, dst, 1_000)
        proc.stderr.close()  # tee is gone
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert len(_decode(dst)) > 0 and not partial_path(dst).exists()


def _two_outputs_without_engine(first: Path, second: Path | str, setup: str, max_frames: int, size=(64, 64),
                                osc_port: int | None = None):
    """A player run in a process of its own (a real SIGINT reaches it) with the engine left out, each input frame
    going straight to the two outputs; `setup` patches it (a signal at a chosen moment). Returns the process."""
    script = textwrap.dedent("""
        import signal
        from loom_live.plugin.media.sinks import FrameSink
        from loom_live.plugin.player.app import Player
        from loom_live.plugin.player.options import PlayerOptions

        def straight_to_the_outputs(self):
            for frame in self._frames():
                self._emit(frame)

        Player._start_engine = Player._wait_ready = Player._report_style = lambda self, *args, **kwargs: None
        Player._run_lossless = straight_to_the_outputs
    """) + textwrap.dedent(setup) + textwrap.dedent(f"""
        print("exit", Player(PlayerOptions(outputs=[{str(first)!r}, {str(second)!r}], max_frames={max_frames},
                                           size={size!r}, osc_port={osc_port!r})).run())
    """)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_ctrl_c_again_while_the_outputs_are_finalised_finishes_every_one(tmp_path):
    """Ctrl-C pressed twice: the second one lands while the first output is finalised. Every output is still
    finished and put in place (the second was left half written under its hidden name), and the run ends with
    its report and 130."""
    first, second = tmp_path / "first.mp4", tmp_path / "second.mkv"
    out = _two_outputs_without_engine(first, second, """
        def stopped_after_three_frames(self):
            for frame in list(self._frames())[:3]:
                self._emit(frame)
            raise KeyboardInterrupt  # the first Ctrl-C

        close = FrameSink.close

        def close_and_ctrl_c_again(self, keep=True, stopping=False):
            close(self, keep, stopping)
            signal.raise_signal(signal.SIGINT)

        Player._run_lossless = stopped_after_three_frames
        FrameSink.close = close_and_ctrl_c_again
    """, 3)
    assert out.stdout.strip() == "exit 130", out.stderr
    assert "stopped by Ctrl-C; 3 frames" in out.stderr and "Traceback" not in out.stderr
    assert len(_decode(first)) == 3 and len(_decode(second)) == 3
    assert sorted(tmp_path.iterdir()) == [first, second], "a hidden partial was left behind"


def _with_a_stalled_stream(tmp_path: Path, stop: str, osc_port: int | None = None) -> tuple[Path, str, list[str], str]:
    """A run to a file and to an RTMP server that takes nothing more (_two_outputs_without_engine), stopped by the
    line `stop` once the stream's write waits on it (wait_until_stuck). Returns the file, the stream's URL, the
    lines the run printed (its exit code, then the seconds from the stop to its end) and what it said."""
    (tmp_path / "outputs").mkdir()
    first, read_all = tmp_path / "outputs" / "first.mkv", tmp_path / "read-all"
    url, server = rtmp_server(f"open({str(read_all)!r}, 'w').close()\ntime.sleep(120)")
    try:
        out = _two_outputs_without_engine(first, url, f"""
            import atexit, os, threading, time
            from pathlib import Path
            import numpy as np
            from loom_live.plugin.media import network_output
            from loom_live.plugin.player import app
            from tests.fakes.media import open_when_listening, small_send_buffers, wait_until_stuck

            network_output.NETWORK_STALL_S = 60.0  # a stop that waited on the receiver would take a minute or two
            small_send_buffers()
            noise = np.random.default_rng(0).integers(0, 256, (8, 256, 256, 3), dtype=np.uint8)  # more than they hold
            Player._fit = lambda self, frame: noise[self.frames_in % 8]
            open_sink = app.open_sink
            app.open_sink = lambda spec, fps, size, **kwargs: (open_when_listening(spec, size) if spec == {url!r}
                                                               else open_sink(spec, fps, size, **kwargs))
            start_sending, pressed = network_output.NetworkSender.__init__, []

            def start_sending_and_stop_once_stuck(self, sink, while_waiting=None):
                start_sending(self, sink, while_waiting)

                def stop_once_stuck():
                    wait_until_stuck(self._queue, Path({str(read_all)!r}))
                    pressed.append(time.monotonic())
                    {stop}

                threading.Thread(target=stop_once_stuck, daemon=True).start()

            network_output.NetworkSender.__init__ = start_sending_and_stop_once_stuck
            atexit.register(lambda: print(f"{{time.monotonic() - pressed[0]:.1f}}"))
        """, 10**6, size=(256, 256), osc_port=osc_port)
    finally:
        server.kill()
        server.wait()
    return first, url, out.stdout.splitlines(), out.stderr


def test_a_ctrl_c_with_a_stalled_stream_output_ends_the_run_at_once_and_the_file_whole(tmp_path):
    """A streaming server that takes nothing more: a Ctrl-C waited the stream's stall timeout (5 s; a minute here)
    before the run stopped. Now the stream is given up on within STOP_GRACE_S and said to be, while the file is
    finished with every frame the report counts."""
    first, url, lines, err = _with_a_stalled_stream(tmp_path, "os.kill(os.getpid(), signal.SIGINT)")
    assert lines[0] == "exit 130", "\n".join(lines) + err
    assert float(lines[1]) < 30, f"the stop took {lines[1]} s: it waited on the stalled stream"
    assert f"output cut off at the stop: {url}: stopped; the receiver took nothing for 0.5 s" in err
    counted = re.search(r"stopped by Ctrl-C; (\d+) frames", err)
    assert counted and len(_decode(first)) == int(counted[1]) > 0, err
    assert sorted(first.parent.iterdir()) == [first], "a hidden partial was left behind"


def test_an_osc_quit_with_a_stalled_stream_output_ends_the_run_at_once_and_the_file_whole(tmp_path):
    """A quit over OSC while a write waits on a streaming server that takes nothing more: the frame loop read it
    only once that write gave up, after the stream's stall timeout (5 s; a minute here). Now the quit cuts the
    wait short as a Ctrl-C does: the stream is given up on and said to be, the file finished with every frame.
    A quit is a normal stop, yet the stream cut off at it ended the run with exit code 2 ("an output failed"),
    where Ctrl-C counts it as part of the stop: now the quit ends with 0."""
    pytest.importorskip("pythonosc", reason="OSC input needs the osc extra (python-osc)")
    port = free_udp_port()
    send_quit = "from pythonosc.udp_client import SimpleUDPClient; " \
                f"SimpleUDPClient('127.0.0.1', {port}).send_message('/loom/quit', [])"
    first, url, lines, err = _with_a_stalled_stream(tmp_path, send_quit, osc_port=port)
    assert lines[0] == "exit 0", "\n".join(lines) + err  # no output failed before the quit
    assert float(lines[1]) < 30, f"the quit took {lines[1]} s: it waited on the stalled stream"
    assert f"output cut off at the stop: {url}: stopped; the receiver took nothing for 0.5 s" in err
    counted = re.search(r": (\d+) frames \(256x256", err)
    assert counted and len(_decode(first)) == int(counted[1]) > 0, err
    assert sorted(first.parent.iterdir()) == [first], "a hidden partial was left behind"


class _KeyWindow:
    """A preview window (PreviewWindow) whose key poll between frames (poll_key, as a write waits) finds ``keys``,
    one a poll, then none; nothing is pressed as a frame is shown."""

    def __init__(self, keys: str) -> None:
        self.keys = list(keys)
        self.polls = 0

    def show(self, frame: np.ndarray, lines: list[str], fullscreen: bool) -> int:
        return -1

    def poll_key(self) -> int:
        self.polls += 1
        return ord(self.keys.pop(0)) if self.keys else -1

    def closed_by_user(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_a_quit_key_with_a_stalled_stream_output_ends_the_run_at_once(tmp_path, monkeypatch, capsys):
    """`q` in the window while a write waits on a stream whose receiver takes nothing: the window's keys were read
    only between frames, on the thread that waits, so the quit waited out the stream's stall limit (5 s; a minute
    here) where an OSC quit or Ctrl-C cut it short, and the stream then failed, ending the run with 2. Now the key
    is read while the write waits: the stream is cut off at the stop and said to be, and the quit ends with 0."""
    from loom_live.plugin.media import network_output
    from loom_live.plugin.media.sinks import FrameSink
    from loom_live.plugin.player import window
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    url, released, encode = f"udp://127.0.0.1:{free_udp_port()}", threading.Event(), FrameSink._encode

    def stalled_if_streamed(self, frame, pts):  # the stream's receiver takes nothing: its first send never ends
        if self.is_network:
            released.wait()
        else:
            encode(self, frame, pts)

    keys = _KeyWindow("q")
    _without_engine(monkeypatch)
    monkeypatch.setattr(network_output, "NETWORK_STALL_S", 60.0)  # a quit that waited on it would take a minute
    monkeypatch.setattr(FrameSink, "_encode", stalled_if_streamed)
    monkeypatch.setattr(window, "PreviewWindow", lambda: keys)
    player = Player(PlayerOptions(outputs=["window", url], max_frames=50, size=(64, 64)))
    player.controls.put(Command("overlay"))  # `h`: no overlay, which would ask the engine left out for its status
    started = time.monotonic()
    try:
        code = player.run()
    finally:
        released.set()
    took = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"output cut off at the stop: {url}: stopped; the receiver took nothing for 0.5 s" in err
    assert not keys.keys, "the key was never read while the write waited"
    assert took < 30, f"the quit took {took:.1f} s: it waited on the stalled stream"
    counted = re.search(r": (\d+) frames \(64x64", err)
    assert counted and int(counted[1]) < 50, err


@pytest.mark.parametrize(("signame", "stopped_by", "code"), [("SIGINT", "Ctrl-C", 130), ("SIGTERM", "SIGTERM", 143)])
def test_a_stop_signal_while_the_last_output_fails_still_stops_the_run(tmp_path, signame, stopped_by, code):
    """Ctrl-C (or SIGTERM) held back while the third frame was written, and that write failed on every output (a
    full drive): the signal was lost and the run ended as failed, with 2. Now it ends as stopped by it, with its
    exit code, and the failure is still said."""
    first, second = tmp_path / "first.mp4", tmp_path / "second.mkv"
    out = _two_outputs_without_engine(first, second, f"""
        from loom_live.plugin.media.base import MediaError

        def write_or_fail(self, frame, write=FrameSink.write):
            if self.frames_written < 2:
                return write(self, frame)
            if self.name == {str(first)!r}:
                signal.raise_signal(signal.{signame})  # held back until every output has had the frame
            raise MediaError(f"{{self.name}}: writing failed: No space left on device")

        FrameSink.write = write_or_fail
    """, 10)
    assert out.stdout.strip() == f"exit {code}", out.stderr
    assert f"error: output: {second}: writing failed: No space left on device\n" in out.stderr
    assert f"stopped by {stopped_by}; 2 frames" in out.stderr and "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == [], "a failed output left a file"


def _without_engine(monkeypatch) -> None:
    """An in-process run with the engine left out: each input frame goes to the outputs as it is."""
    from loom_live.plugin.player.app import Player

    def straight_to_the_outputs(self):
        for frame in self._frames():
            self._emit(frame)

    for name in ("_start_engine", "_wait_ready", "_report_style"):
        monkeypatch.setattr(Player, name, lambda self, *args, **kwargs: None)
    monkeypatch.setattr(Player, "_run_lossless", straight_to_the_outputs)


class _ReadyFromThirdFrame:
    """A bridge whose engine delivers from the third frame on (inverted, as a restyle): before that, `latest()`
    hands back the input as the fallback, as a starting engine's bridge does."""

    def __init__(self) -> None:
        self.last_seq = -1
        self._input: np.ndarray | None = None

    def submit(self, frame: np.ndarray) -> None:
        self.last_seq += 1
        self._input = frame

    def latest(self) -> tuple[np.ndarray | None, object]:
        from loom_live.host_bridge.bridge_stats import BridgeStatus
        from loom_live.host_bridge.supervisor import EngineState

        if self.last_seq < 2:
            return self._input, BridgeStatus(state=EngineState.STARTING)
        return 255 - self._input, BridgeStatus(state=EngineState.RUNNING, fallback=False, seq=self.last_seq)

    def stats(self) -> dict[str, object]:
        return {}

    def engine_start(self) -> None:
        return None

    def close(self) -> None:
        pass


def test_a_live_run_says_how_many_frames_went_out_before_the_engine_delivered(tmp_path, monkeypatch, capsys):
    """A short live run (`--mode live -n 60`) could end before the engine's first restyled frame: exit 0, a file of
    the input as it came, and a report that read like a restyled run. The report now counts those frames."""
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    def with_the_bridge(self) -> None:
        self.bridge = _ReadyFromThirdFrame()

    monkeypatch.setattr(Player, "_start_engine", with_the_bridge)
    monkeypatch.setattr(Player, "_report_style", lambda self, *args, **kwargs: None)
    out = tmp_path / "live.mp4"
    code = Player(PlayerOptions(outputs=[str(out)], mode="live", max_frames=5, size=(64, 64), fps=1000)).run()
    err = capsys.readouterr().err
    assert code == 0, err
    assert "5 frames (64x64, 1000 fps; 2 unrestyled, the input shown while the engine started or restarted)" in err
    assert len(_decode(out)) == 5


def test_quiet_leaves_only_the_last_line_a_script_logs(tmp_path, monkeypatch, capsys):
    """-q hid the run's last line too (frames, where they went): a script that ran the player quietly could not
    log what it wrote. It hides what goes by, and keeps that line."""
    from loom_live.plugin.player import PlayerOptions, run_player

    _without_engine(monkeypatch)
    out = tmp_path / "quiet.mp4"
    assert run_player(PlayerOptions(outputs=[str(out)], max_frames=3, size=(64, 64), fps=10, quiet=True)) == 0
    assert re.fullmatch(rf"loom play: 3 frames \(64x64, 10 fps\) to {re.escape(str(out))} in [\d.]+ s\n",
                        capsys.readouterr().err)


class _NeverReady:
    """A bridge whose engine is still launching, whatever the wait."""

    def status(self) -> object:
        from loom_live.host_bridge.bridge_stats import BridgeStatus
        from loom_live.host_bridge.supervisor import EngineState

        return BridgeStatus(state=EngineState.STARTING, message="launching the engine")

    def stats(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        pass


def test_an_engine_not_ready_in_time_is_said_with_the_option_that_sets_the_wait(tmp_path, monkeypatch, capsys):
    from loom_live.plugin.player import PlayerOptions, run_player
    from loom_live.plugin.player.app import Player

    monkeypatch.setattr(Player, "_start_engine", lambda self: setattr(self, "bridge", _NeverReady()))
    options = PlayerOptions(outputs=[str(tmp_path / "x.mp4")], max_frames=3, size=(64, 64), startup_timeout_s=0.01)
    assert run_player(options) == 3
    assert ("loom play: error: the engine did not become ready within 0.01 s: launching the engine (--startup-timeout "
            "S sets the wait, 300 s by default)\n") in capsys.readouterr().err


def test_a_folder_given_as_the_prompt_list_is_named_as_a_folder(tmp_path):
    from loom_live.plugin.player import PlayerError, read_prompt_file

    with pytest.raises(PlayerError, match=r"--prompts: .* is a folder; give a text file with one prompt per line"):
        read_prompt_file(str(tmp_path))


def test_a_ctrl_c_while_a_frame_is_written_is_counted_as_the_files_hold_it(tmp_path):
    """Ctrl-C lands while the third frame is written to the first of two outputs: that frame goes to both
    (neither file is a frame short of the other) and the report counts it (it said one frame fewer than the
    files hold)."""
    first, second = tmp_path / "first.mp4", tmp_path / "second.mkv"
    out = _two_outputs_without_engine(first, second, f"""
        encode = FrameSink._encode

        def encode_then_ctrl_c(self, frame, pts):
            encode(self, frame, pts)
            if pts == 2 and self.name == {str(first)!r}:
                signal.raise_signal(signal.SIGINT)

        FrameSink._encode = encode_then_ctrl_c
    """, 10)
    assert out.stdout.strip() == "exit 130", out.stderr
    assert "stopped by Ctrl-C; 3 frames" in out.stderr, out.stderr
    assert len(_decode(first)) == 3 and len(_decode(second)) == 3


def test_an_output_that_fails_and_cannot_be_removed_names_the_file_left_behind(tmp_path, monkeypatch, capsys):
    """An output fails mid-run on a drive gone read-only: its hidden partial cannot be removed either. The
    failure line names it (it was left there unsaid); the other output goes on."""
    from loom_live.plugin.media.sinks import FrameSink
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    broken, kept = tmp_path / "broken.mkv", tmp_path / "kept.mkv"
    encode, unlink = FrameSink._encode, Path.unlink

    def encode_or_fail(self, frame, pts):
        if self.name == str(broken) and pts == 2:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        encode(self, frame, pts)

    def unlink_unless_broken(self, *args, **kwargs):
        if self == partial_path(broken):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        unlink(self, *args, **kwargs)

    _without_engine(monkeypatch)
    monkeypatch.setattr(FrameSink, "_encode", encode_or_fail)
    monkeypatch.setattr(Path, "unlink", unlink_unless_broken)
    code = Player(PlayerOptions(outputs=[str(broken), str(kept)], max_frames=5, size=(64, 64))).run()
    err = capsys.readouterr().err
    assert code == 2, err
    assert (f"{broken}: writing failed: Read-only file system; {partial_path(broken)} is left behind (removing it "
            "failed too); this output is stopped, the others go on") in err
    assert len(_decode(kept)) == 5


def _quit_after(frames: int, player, monkeypatch) -> None:
    """A quit queued as the player's `frames`-th frame goes out, as a performer's key or OSC quit would come."""
    emit = player._emit

    def emit_then_quit(frame, seq=-1):
        emit(frame, seq)
        if player.frames_out == frames:
            player.controls.put(Command("quit"))

    monkeypatch.setattr(player, "_emit", emit_then_quit)


def test_a_quit_after_an_output_failed_still_ends_with_exit_code_2(tmp_path, monkeypatch, capsys):
    """A quit is a normal stop (a stream cut off at it is no failure), but an output that failed before it did
    fail: the run says so with exit code 2, as it does when the input ends; the other output is whole."""
    from loom_live.plugin.media.sinks import FrameSink
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    broken, kept = tmp_path / "broken.mkv", tmp_path / "kept.mkv"
    encode = FrameSink._encode

    def encode_or_fail(self, frame, pts):
        if self.name == str(broken) and pts == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        encode(self, frame, pts)

    _without_engine(monkeypatch)
    monkeypatch.setattr(FrameSink, "_encode", encode_or_fail)
    player = Player(PlayerOptions(outputs=[str(broken), str(kept)], max_frames=50, size=(64, 64)))
    _quit_after(4, player, monkeypatch)
    code = player.run()
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{broken}: writing failed: No space left on device; this output is stopped, the others go on" in err
    counted = re.search(r": (\d+) frames \(64x64", err)
    assert counted and len(_decode(kept)) == int(counted[1]) < 50, err
    assert not broken.exists()


def test_no_frame_is_read_or_written_after_a_quit(tmp_path, monkeypatch, capsys):
    """A quit is applied at the top of the frame loop: the loop read and wrote one more frame after it, so a file
    output held a frame the performer had already stopped. The file ends at the frame the quit came after."""
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    out = tmp_path / "out.mkv"
    _without_engine(monkeypatch)
    player = Player(PlayerOptions(outputs=[str(out)], max_frames=50, size=(64, 64)))
    _quit_after(4, player, monkeypatch)
    assert player.run() == 0, capsys.readouterr().err
    assert player.frames_in == player.frames_out == 4
    assert len(_decode(out)) == 4


@pytest.mark.parametrize(("quiet", "ctrl_c"), [(False, False), (True, False), (False, True)])
def test_a_file_saved_at_the_output_during_a_run_without_y_is_kept_and_the_report_says_once_where_the_run_went(
        tmp_path, monkeypatch, capsys, caplog, quiet, ctrl_c):
    """Without -y an existing output is refused at open; one saved there during the run (another program, another
    take) was replaced at the end. It stays, and the run's last line names where the run's file went instead: once
    (a log line said it too), after a Ctrl-C as well, and in a quiet run (-q), whose last line is otherwise not
    said."""
    from loom_live.plugin.media.partial_files import aside_path
    from loom_live.plugin.media.sinks import FrameSink
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    dst = tmp_path / "show.mp4"
    encode, emit = FrameSink._encode, Player._emit

    def encode_then_someone_saves(self, frame, pts):
        encode(self, frame, pts)
        if pts == 2:
            dst.write_bytes(b"saved by someone else")

    def emit_then_ctrl_c(self, frame, seq=-1):
        emit(self, frame, seq)
        if self.frames_out == 4:
            raise KeyboardInterrupt

    _without_engine(monkeypatch)
    monkeypatch.setattr(FrameSink, "_encode", encode_then_someone_saves)
    if ctrl_c:
        monkeypatch.setattr(Player, "_emit", emit_then_ctrl_c)
    code = Player(PlayerOptions(outputs=[str(dst)], max_frames=5, size=(64, 64), quiet=quiet)).run()
    err = capsys.readouterr().err
    mine, frames = aside_path(dst, 1), 4 if ctrl_c else 5
    assert code == (130 if ctrl_c else 0), err
    assert dst.read_bytes() == b"saved by someone else" and len(_decode(mine)) == frames
    assert f"{frames} frames (64x64, 24 fps) to {mine} ({dst} appeared during the run and was left as it was) in " \
        in err and err.count(str(mine)) == 1 and str(mine) not in caplog.text, (err, caplog.text)


def test_a_failed_run_says_where_its_file_went_when_one_was_saved_at_the_output_as_it_finished(
        tmp_path, monkeypatch, capsys):
    """A failed run keeps the frames written before the failure in a new file, and has no last line to say where
    it went: a file saved at the output as the run's was moved into place sends it beside it, said in one line."""
    from loom_live.plugin.media.partial_files import aside_path
    from loom_live.plugin.media.sinks import FrameSink
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerError, PlayerOptions

    dst = tmp_path / "show.mp4"
    move = FrameSink._move_into_place

    def someone_saves_then_move(self):
        dst.write_bytes(b"saved by someone else")
        return move(self)

    def three_frames_then_fail(self):
        for frame in self._frames():
            self._emit(frame)
            if self.frames_out == 3:
                raise PlayerError("input: the camera is gone")

    _without_engine(monkeypatch)
    monkeypatch.setattr(Player, "_run_lossless", three_frames_then_fail)
    monkeypatch.setattr(FrameSink, "_move_into_place", someone_saves_then_move)
    with pytest.raises(PlayerError, match="the camera is gone"):
        Player(PlayerOptions(outputs=[str(dst)], max_frames=5, size=(64, 64), quiet=True)).run()
    mine = aside_path(dst, 1)
    assert dst.read_bytes() == b"saved by someone else" and len(_decode(mine)) == 3
    assert capsys.readouterr().err == (f"loom play: this run's output is {mine} ({dst} appeared during the run and "
                                       "was left as it was)\n")


def test_a_file_cut_short_is_said_to_end_before_the_frames_its_header_states(tmp_path, monkeypatch, capsys):
    """A copy cut at half its bytes decodes to its cut without an error: the run ended with exit 0 and "N
    frames", as if complete. It still ends with 0, and a last line says how far short it came, -q or not (a
    result a script needs, as the line before it is); a whole file, and a run that --frames ends early, say
    nothing of the kind."""
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    _without_engine(monkeypatch)
    whole = noise_clip(tmp_path / "whole.mkv", 60)
    cut = tmp_path / "cut.mkv"
    data = whole.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    runs = {}
    for name, clip, frames, quiet in (("cut", cut, None, False), ("quiet", cut, None, True),
                                      ("whole", whole, None, False), ("limited", whole, 20, False)):
        code = Player(PlayerOptions(input=str(clip), outputs=[str(tmp_path / f"{name}_out.mp4")],
                                    max_frames=frames, quiet=quiet)).run()
        runs[name] = (code, capsys.readouterr().err)
    written = len(_decode(tmp_path / "cut_out.mp4"))
    note = f"loom play: input ended after {written} of the 60 frames its header states (a file cut short?)"
    code, err = runs["cut"]
    assert code == 0 and 0 < written < 55, err
    assert err.rstrip().endswith(note), err
    code, err = runs["quiet"]
    assert code == 0 and err.splitlines()[-2].startswith(f"loom play: {written} frames") and \
        err.splitlines()[-1] == note, err
    for name in ("whole", "limited"):
        code, err = runs[name]
        assert code == 0 and "input ended after" not in err, err


def test_a_file_render_survives_an_engine_crash_without_losing_a_frame(tmp_path):
    """SIGKILL the engine mid-file: the bridge restarts it and the player resends the batch in flight."""
    dst = tmp_path / "survived.mp4"
    n = 1200
    proc = _file_run(dst, n, "32x32")
    try:
        _wait_writing(proc, dst, 2_000)
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        engines = [pid for pid in children if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(engines) == 1, children  # the engine process this player launched
        os.kill(int(engines[0]), signal.SIGKILL)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    frames = _decode(dst)
    assert len(frames) == n, "every frame written once, none lost or doubled by the restart"
    from loom_live.plugin.media.generated_clip import generate_clip

    source = np.stack(list(generate_clip(n, size=(32, 32), fps=24.0, seed=0)))
    aligned = np.mean([_psnr(frames[i], source[i]) for i in range(n - 1)])
    shifted = np.mean([_psnr(frames[i], source[i + 1]) for i in range(n - 1)])
    assert aligned > shifted + 3, "every frame in its place, also around the restart"


# --- bad inputs: one clear line, a documented exit code, never a traceback ----------------------


@pytest.mark.parametrize("make_input, expected", [
    (lambda d: str(d / "missing.mp4"), "video file not found"),
    (lambda d: _garbage(d / "broken.mp4"), "not a readable video"),
    (lambda d: _audio_only(d / "voice.m4a"), "contains no video stream"),
    (lambda d: "97", "camera 97 could not be opened"),
    (lambda d: "rtsp://127.0.0.1:9/stream", "rtsp://127.0.0.1:9/stream: cannot open"),
    (lambda d: "gopher://example/x", "unsupported URL scheme 'gopher'"),
])
def test_bad_inputs_end_with_a_clear_message(tmp_path, capsys, make_input, expected):
    # in this process: `loom` exits with what main() returns (a real process is run by the tests above)
    code = main(["play", "-i", make_input(tmp_path), "-o", str(tmp_path / "never.mp4")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err
    assert "Traceback" not in err
    assert not (tmp_path / "never.mp4").exists()


def test_an_output_equal_to_the_input_or_existing_is_refused_and_left_untouched(tmp_path):
    clip = write_clip(tmp_path / "mine.mp4", [np.full((48, 64, 3), 90, np.uint8)] * 8)
    before = clip.read_bytes()
    same = _play("-i", str(clip), "-o", str(tmp_path / "." / "mine.mp4"), "-y", "--passthrough", timeout=60)
    assert same.returncode == 2 and "is the input file" in same.stderr, same.stderr
    exists = _play("-i", str(clip), "-o", str(clip.with_name("other.mp4")), "--passthrough", timeout=60)
    assert exists.returncode == 0, exists.stderr
    again = _play("-i", str(clip), "-o", str(clip.with_name("other.mp4")), "--passthrough", timeout=60)
    assert again.returncode == 2 and "exists; give --overwrite (-y)" in again.stderr, again.stderr
    assert clip.read_bytes() == before


def test_outputs_and_rates_no_run_could_write_are_refused_before_the_engine_starts(tmp_path, capsys):
    """A folder given as -o (even with -y), one file given twice, a generated clip's rate no video file holds, a size
    larger than H.264 takes: each would fail after the whole run (or write frames no player decodes, or fail naming
    neither the size nor the limit), so each is refused at once."""
    folder = tmp_path / "renders.mp4"
    folder.mkdir()
    cases = [
        (["-o", str(folder), "-y"], "is a folder; give a file in it"),
        (["-o", str(tmp_path / "a.mp4"), "-o", str(tmp_path / "." / "a.mp4")], "is given twice"),
        (["--fps", "100000", "-o", str(tmp_path / "b.mp4")], "--fps: 100000 is not allowed; expected 0.01 to 1000"),
        (["--fps", "nan", "-o", str(tmp_path / "b.mp4")], "--fps: nan is not allowed"),
        (["--size", "20000x20000", "-o", str(tmp_path / "b.mp4")],
         f"output: {tmp_path / 'b.mp4'}: 20000x20000 is larger than H.264 takes (at most 16384 px a side"),
    ]
    for args, expected in cases:
        assert main(["play", "-n", "5", *args]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["renders.mp4"]


def test_options_no_run_can_use_are_refused_as_options_before_the_engine_starts(tmp_path, capsys):
    """A start-up timeout of 0 or less ended as if the engine had failed (exit code 3, "did not become ready within
    -5 s") and NaN was taken; --fps with an input was dropped without a word (the input's rate was written);
    udp:// without a port started the run and failed 5 s in ("the receiver took nothing"). Each is refused as a
    bad option, with exit code 2, before anything is written."""
    clip = write_clip(tmp_path / "clip.mp4", [np.full((48, 64, 3), 90, np.uint8)] * 5)
    out = tmp_path / "out.mp4"
    cases = [
        (["--startup-timeout", "0"], "--startup-timeout: 0 is not allowed; expected a number of seconds above 0"),
        (["--startup-timeout", "-5"], "--startup-timeout: -5 is not allowed"),
        (["--startup-timeout", "nan"], "--startup-timeout: nan is not allowed"),
        (["-i", str(clip), "--fps", "10"], "--fps sets the generated clip's frame rate; input"),
        (["-o", "udp://127.0.0.1"], "expected udp://HOST:PORT"),
    ]
    for args, expected in cases:
        assert main(["play", "-n", "5", "--passthrough", "-o", str(out), *args]) == 2, args
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.mp4"]


def test_a_prompt_list_saved_with_a_byte_order_mark_keeps_its_comment_a_comment(tmp_path):
    from loom_live.plugin.player import read_prompt_file

    path = tmp_path / "show.txt"
    path.write_bytes("\ufeff# my show\nink wash\nneon city\n".encode())
    assert read_prompt_file(str(path)) == ["ink wash", "neon city"]


def test_a_failed_run_leaves_an_existing_output_as_it_was(tmp_path):
    """The engine cannot start (exit 3) after the output was opened: with -y the old file still stands."""
    dst = tmp_path / "kept.mp4"
    dst.write_bytes(b"yesterday's render")
    out = _play("-n", "10", "--size", "64x64", "-o", str(dst), "-y", "--engine-python", "/bin/false", timeout=120)
    assert out.returncode == 3, out.stderr
    assert dst.read_bytes() == b"yesterday's render"
    assert not partial_path(dst).exists()


def _garbage(path: Path) -> str:
    # Fixed bytes: some random draws happen to probe as a raw h263 or audio stream.
    path.write_bytes(random.Random(0).randbytes(4096))
    return str(path)


def _audio_only(path: Path) -> str:
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("aac", rate=48000)
        samples = np.zeros((1, 48000), dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = 48000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return str(path)


@pytest.mark.parametrize("args, expected", [
    (["-o", "ftp://host/x"], "unsupported URL scheme 'ftp'"),
    (["-o", "/no/such/folder/x.mp4"], "output folder does not exist"),
    (["-o", "clip.avi"], "must end in one of .mp4, .mkv, .mov"),
    (["--set", "stream.stepz=[700]"], "stream.stepz: unknown key (did you mean 'steps'?)"),
    (["-c", "edit-tiny", "--lora", "ink.safetensors"], "lora: model.family=edit does not read it"),  # ran without it
    (["-c", "tiny-random", "--set", "edit.batch=4"], "edit.batch: model.family=wan does not read it"),
    (["--prompts", "/no/such/prompts.txt"], "--prompts: file not found"),
    # said as missing and by the option (the engine started, then said the file "cannot be opened as a video")
    (["-c", "tiny-vace", "--control", "nosuch.mp4"], "loom play: error: --control nosuch.mp4: no such file; expected "
                                                     "edges, grey, flow, depth or a video file\n"),
    (["-c", "tiny-vace", "--reference", "nosuch.png"], "loom play: error: --reference nosuch.png: no such file"),
    (["--lora", "nosuch.safetensors"], "loom play: error: lora (--lora): nosuch.safetensors: no such file or "
                                       "directory"),
])
def test_bad_options_end_with_a_clear_message(tmp_path, capsys, monkeypatch, args, expected):
    monkeypatch.chdir(tmp_path)
    code = main(["play", "-n", "5", "--size", "32x32", *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir()), "a refused run left a file behind"


def test_play_reaches_an_engine_served_on_this_machine_with_its_session_secret(tmp_path):
    """`loom serve --bind` on a loopback endpoint takes only hosts that hold its secret file: with the same
    --secret-file the player streams through it; the served engine keeps running afterwards."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"

    def listening() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        return serve.poll() is not None

    secret = tmp_path / "secret"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    serve = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "serve", "--bind", endpoint,
                              "--secret-file", str(secret), "--passthrough"], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert wait_until(listening, 60) and serve.poll() is None, serve.stderr
        dst = tmp_path / "out.mp4"
        out = _play("-n", "6", "--size", "32x32", "-o", str(dst), "--endpoint", endpoint, "--secret-file",
                    str(secret), "--passthrough", timeout=120)
        assert out.returncode == 0, out.stderr
        assert len(_decode(dst)) == 6 and serve.poll() is None
    finally:
        serve.terminate()
        serve.communicate(timeout=30)


def test_a_player_on_a_served_engine_refuses_live_prompts_in_the_engine_s_family_s_words(tmp_path, capsys):
    """`loom play --endpoint` took the model family from its own -c config: OSC, the page and the keys refused an
    empty prompt sent to a served edit engine asking for "a few words describing the style". Until the engine has
    said its family, each family's words are said; then its own, and one that is not the config's is said once.
    A served engine of the config's family says nothing."""
    from loom_live.engine.config import load_config
    from loom_live.engine.server.passthrough import PassthroughSession
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    for served, family, takes in (("edit-tiny", "edit", "an instruction, such as 'make it a watercolor painting'"),
                                  ("tiny-random", "wan", "a few words describing the style")):
        with InProcessEngine(PassthroughSession, start=load_config(served).start_settings()) as engine:
            player = Player(PlayerOptions(outputs=[str(tmp_path / f"{served}.mp4")], max_frames=3, size=(32, 32),
                                          endpoint=engine.endpoint, secret_file=engine.secret_file))
            with pytest.raises(ControlError, match=r"style \(the wan family\) or an instruction, .* \(the edit"):
                command_for("/loom/prompt", (" ",), player.controls.state.family)  # as the OSC thread asks
            assert player.run() == 0
        err = capsys.readouterr().err
        assert player.controls.state.family == family
        with pytest.raises(ControlError) as refused:
            command_for("/loom/prompt", (" ",), player.controls.state.family)
        assert str(refused.value) == f"the prompt is empty; give {takes}"
        line = "loom play: the engine runs the edit model family, not the wan family of -c default: its prompt is " \
               "an instruction, such as 'make it a watercolor painting'"
        assert err.count(line) == (family == "edit") and "model family" not in err.replace(line, ""), err


def _served_run(tmp_path, monkeypatch, served, **options):
    """A player run on an engine served with config `served` (`ConfigSessions`: it refuses a parameter its family does
    not take): the player, what it handed to `Bridge.set_params`, and the engine's session."""
    from loom_live.host_bridge import Bridge
    from loom_live.plugin.player.app import Player
    from loom_live.plugin.player.options import PlayerOptions

    sent: list[dict] = []
    set_params = Bridge.set_params

    def recorded(bridge, **params):
        sent.append(params)
        set_params(bridge, **params)

    monkeypatch.setattr(Bridge, "set_params", recorded)
    sessions = ConfigSessions(served)
    with InProcessEngine(sessions, start=sessions.start) as engine:
        player = Player(PlayerOptions(outputs=[str(tmp_path / "out.mp4")], max_frames=3, size=(32, 32),
                                      endpoint=engine.endpoint, secret_file=engine.secret_file, **options))
        assert player.run() == 0
    [session] = sessions.built
    return player, sent, session


def test_a_player_on_a_served_engine_shows_its_starting_settings_and_sends_none_it_does_not_take(tmp_path, capsys,
                                                                                               monkeypatch):
    """`loom play -c default --set noise.noise_scale=0.5 --endpoint` on an edit engine: the controls showed -c's
    prompt, and sent the engine Wan parameters it refuses by name. They take its prompt, and refuse what it does not
    take (the --set one said once, the keys' each time) without sending it."""
    from loom_live.engine.config import load_config

    served = load_config("edit-tiny")
    player, sent, session = _served_run(tmp_path, monkeypatch, served, noise_scale=0.5,
                                        given_params={"noise_scale": 0.5})
    s, takes = player.controls.state, ", ".join(sorted(served.start_settings()["params"]))
    assert s.prompts == ["make it a watercolor"] and s.takes == set(served.start_settings()["params"])
    assert sent == [] and session.refused == [] and s.settings_line() == "adapter 1.00"  # and no Wan settings
    err = capsys.readouterr().err
    assert "loom play: the engine started on its own settings, not those of -c default: prompt 'make it a " \
           "watercolor'; the controls follow it (-p and --set choose others)\n" in err, err
    assert f"loom play: the engine does not take noise_scale: not sent (it takes {takes})\n" in err, err
    bridge = RecordingBridge()
    KeyboardInput(player.controls).press(ord("]"))
    assert player.controls.apply_pending(bridge) == [f"noise_scale: the engine's model (edit family) does not take "
                                                     f"it; it takes {takes}"]
    assert bridge.params == [] and s.refused == 1 and s.noise_scale == 0.5


class _OverlayKeys:
    """A preview window (PreviewWindow) that keeps the overlay's lines of each frame shown and, as frames are shown,
    presses each key of ``keys`` in turn, one a frame, then `q` once ``done()`` holds."""

    def __init__(self, keys: str, done: Callable[[], bool]) -> None:
        self.keys, self.done = list(keys), done
        self.lines: list[list[str]] = []

    def show(self, frame: np.ndarray, lines: list[str], fullscreen: bool) -> int:
        self.lines.append(list(lines))
        if self.keys:
            return ord(self.keys.pop(0))
        return ord("q") if self.done() else -1

    def poll_key(self) -> int:
        return -1

    def closed_by_user(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_keys_step_the_adapter_strength_of_an_edit_engine_from_the_one_the_command_line_gave(tmp_path, capsys,
                                                                                           monkeypatch):
    """`loom play -c edit-tiny --set edit.adapter_strength=0.6` on a served pass-through edit-tiny engine: the
    engine is told 0.6 once, the overlay shows it (and none of the Wan settings), `'` steps it to 0.65, and the
    engine's session takes that (its config's family share of the live parameters: a Wan one would refuse it)."""
    from loom_live.engine.config import load_config
    from loom_live.host_bridge import Bridge
    from loom_live.plugin.player import window

    sent: list[dict] = []
    set_params = Bridge.set_params

    def recorded(bridge, **params):
        sent.append(params)
        set_params(bridge, **params)

    sessions = ConfigSessions(load_config("edit-tiny"))
    keys = _OverlayKeys("'", lambda: sessions.built[0].params.get("adapter_strength") == 0.65)
    monkeypatch.setattr(Bridge, "set_params", recorded)
    monkeypatch.setattr(window, "PreviewWindow", lambda: keys)
    with InProcessEngine(sessions, start=sessions.start) as engine:
        assert main(["play", "-c", "edit-tiny", "--set", "edit.adapter_strength=0.6", "-n", "2000", "--loop",
                     "--size", "32x32", "-o", "window", "--endpoint", engine.endpoint, "--secret-file",
                     engine.secret_file]) == 0
    [session] = sessions.built
    assert session.params == {"adapter_strength": 0.65} and session.refused == []
    assert sent == [{"adapter_strength": 0.6}, {"adapter_strength": 0.65}]  # each once
    settings = [lines[2] for lines in keys.lines]  # the live line, the prompt, then the settings
    assert settings[0] == "adapter 0.60" and settings[-1] == "adapter 0.65", settings
    assert "loom play: adapter strength: 0.65\n" in capsys.readouterr().err


def _play_served(tmp_path, capsys, served, *options):
    """`loom play --endpoint` on an engine served with preset `served` (`ConfigSessions`: it refuses a parameter its
    family does not take): the exit code, the engine's session and what was said."""
    from loom_live.engine.config import load_config

    sessions = ConfigSessions(load_config(served))
    with InProcessEngine(sessions, start=sessions.start) as engine:
        code = main(["play", "-n", "3", "--size", "32x32", "-o", str(tmp_path / "out.mp4"), "-y", "--endpoint",
                     engine.endpoint, "--secret-file", engine.secret_file, *options])
    [session] = sessions.built
    return code, session, capsys.readouterr().err


def test_loom_play_tells_a_served_engine_the_live_parameters_set_whatever_the_model_of_its_own_config(tmp_path,
                                                                                                      capsys):
    """`loom play -c default --set edit.adapter_strength=0.6 --endpoint` on an edit engine was refused before
    connecting (-c's Wan model reads no edit key), and --set control.context_scale on a -c without structure control
    never reached a served VACE engine. Every live parameter set is sent to the served engine that takes it; one it
    does not take is said, not sent."""
    code, session, err = _play_served(tmp_path, capsys, "edit-tiny", "--set", "edit.adapter_strength=0.6")
    assert code == 0 and session.params == {"adapter_strength": 0.6} and session.refused == [], err
    code, session, err = _play_served(tmp_path, capsys, "tiny-vace", "-c", "tiny-random", "--set",
                                      "control.context_scale=0.5")
    assert code == 0 and session.params == {"context_scale": 0.5} and session.refused == [], err
    code, session, err = _play_served(tmp_path, capsys, "tiny-vace", "--set", "control.control_source=grey")
    assert code == 0 and session.params == {"control_source": "grey"} and session.refused == [], err  # -c: edges only
    code, session, err = _play_served(tmp_path, capsys, "tiny-random", "--set", "edit.adapter_strength=0.6")
    assert code == 0 and session.params == {} and session.refused == [], err
    assert "loom play: the engine does not take adapter_strength: not sent (it takes " in err, err


def test_loom_play_refuses_at_once_a_key_a_served_engine_never_reads(tmp_path, capsys):
    """`--set model.dtype=float16` (or --resolution) with --endpoint went nowhere without a word: the served engine
    runs its own config. It is refused before the engine is reached (nothing answers here), saying what reaches one."""
    endpoint = ["--endpoint", "tcp://127.0.0.1:9", "-o", str(tmp_path / "o.mp4")]
    assert main(["play", "--set", "model.dtype=float16", *endpoint]) == 2
    assert "loom play: error: --set model.dtype=float16: a served engine (--endpoint) runs its own config, and only " \
           "the live parameters reach it (stream.steps, " in capsys.readouterr().err
    assert main(["play", "--resolution", "512x512", *endpoint]) == 2
    assert "loom play: error: --resolution 512x512: a served engine (--endpoint) restyles at its own config's " \
           "resolution; set it where it is served (loom serve --set resolution.width=W --set resolution.height=H), " \
           "or leave out --endpoint\n" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_player_on_a_served_engine_checks_control_and_reference_against_what_it_takes(tmp_path, capsys):
    """`loom play -c default --control grey --endpoint` on a served VACE engine was refused before connecting (-c's
    embedded model reads edges only), and -c's VACE model let --control depth through to a served engine without a
    depth model. The options are checked against what the served engine says it takes once it is ready: a source
    and a reference it takes are sent to it; one it cannot take ends the run (exit 2) naming what it takes, nothing
    sent. --control FILE, a video a served engine never reads, is refused at once."""
    import cv2

    look = tmp_path / "look.png"
    cv2.imwrite(str(look), np.full((8, 6, 3), 9, np.uint8))

    def play(served, *options):
        return _play_served(tmp_path, capsys, served, *options)

    code, session, err = play("tiny-vace", "--control", "grey", "--reference", str(look))
    assert code == 0 and session.refused == [], err
    assert session.params == {"control_source": "grey"} and session.control["reference"] == [8, 6, 3]
    vace = "serve a *vace* preset (loom serve -c wan2.1-vace-1.3b, or tiny-vace on a CPU)"
    for served, options, refusal in (
            ("tiny-vace", ["-c", "tiny-vace", "--control", "depth"], "--control depth: the served engine cannot make "
             "control source 'depth'; it takes edges, grey, flow (depth needs a depth model: control.depth_model in "
             "its config)"),
            ("tiny-vace", ["--set", "control.control_source=depth"], "--set control.control_source=depth: the "
             "served engine cannot make control source 'depth'; it takes edges, grey, flow (depth needs a depth "
             "model: control.depth_model in its config)"),
            ("default", ["--reference", str(look)], "--reference: the served engine's model reads its input's edges "
             f"only and takes no reference image; {vace}"),
            ("tiny-random", ["--control", "edges", "--reference", str(look)], "--control edges and --reference: the "
             f"served engine's model has no VACE control blocks and reads no edges; {vace}")):
        code, session, err = play(served, *options)
        assert code == 2 and f"loom play: error: {refusal}\n" in err, err
        assert session.params == {} and session.control["reference"] is None  # nothing was sent
    clip = noise_clip(tmp_path / "control.mp4", 3)
    assert main(["play", "--control", str(clip), "--endpoint", "tcp://127.0.0.1:9", "-o", str(tmp_path / "o.mp4")]) == 2
    assert "a served engine (--endpoint) reads only the control video its own config names; send this file as the " \
           "control video with --control-input FILE" in capsys.readouterr().err


def test_a_player_on_a_served_engine_keeps_what_the_command_line_set_and_takes_the_rest(tmp_path, capsys,
                                                                                      monkeypatch):
    """-p and --set stream.steps win over a served Wan engine's own, and it is told them; its noise scale and
    motion-aware noise (not -c's) are what the controls show and step from."""
    from loom_live.engine.config import load_config

    served = load_config("tiny-random", ["noise.noise_scale=0.3", "noise.motion_aware=false"])
    player, sent, session = _served_run(tmp_path, monkeypatch, served, prompts=["ink wash"], steps=1,
                                        given_params={"steps": [700]})
    s = player.controls.state
    assert (s.prompts, s.steps, s.noise_scale, s.motion_aware) == (["ink wash"], 1, 0.3, False)
    assert sent == [{"steps": [700]}] and session.refused == []
    assert (session.prompt, session.params) == ("ink wash", {"steps": [700]})
    assert "loom play: the engine started on its own settings, not those of -c default: noise_scale 0.3, " \
           "motion_aware False; the controls follow it" in capsys.readouterr().err
    bridge = RecordingBridge()
    KeyboardInput(player.controls).press(ord("]"))
    player.controls.apply_pending(bridge)
    assert bridge.params == [{"noise_scale": 0.35}]  # from the engine's 0.3, not -c's 0.8


def test_a_player_on_a_served_engine_of_its_own_settings_says_nothing_of_them(tmp_path, capsys, monkeypatch):
    """PlayerOptions' defaults are the schema's, as tiny-random's are."""
    from loom_live.engine.config import load_config

    served = load_config("tiny-random")
    player, sent, session = _served_run(tmp_path, monkeypatch, served)
    assert player.controls.state.prompts == [served.prompt.text] and sent == [] and session.refused == []
    assert "own settings" not in capsys.readouterr().err


def test_loom_play_tells_a_served_engine_what_its_command_line_set(tmp_path, capsys):
    """--set stream.steps and --set prompt.text (which a served engine never reads) are sent to it; -c's other values
    are not."""
    from loom_live.engine.config import load_config

    sessions = ConfigSessions(load_config("tiny-random"))
    with InProcessEngine(sessions, start=sessions.start) as engine:
        assert main(["play", "--endpoint", engine.endpoint, "--secret-file", engine.secret_file, "-n", "3",
                     "--size", "32x32", "-o", str(tmp_path / "out.mp4"), "--set", "stream.steps=[600]",
                     "--set", "prompt.text=ink wash"]) == 0
    [session] = sessions.built
    assert (session.prompt, session.params, session.refused) == ("ink wash", {"steps": [600]}, [])
    err = capsys.readouterr().err
    assert "own settings" not in err and "not sent" not in err, err  # the rest of -c default's are tiny-random's


def test_engine_that_cannot_start_is_reported_with_exit_code_3(tmp_path):
    out = _play("-n", "5", "--size", "32x32", "-o", str(tmp_path / "x.mp4"), "--engine-python",
                str(tmp_path / "no-python"), "--startup-timeout", "20", timeout=60)
    assert out.returncode == 3, out.stderr
    assert "engine" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(os.name == "nt", reason="the stand-in engine Python is a POSIX script")
def test_an_engine_that_dies_while_starting_ends_the_player_at_once_with_its_last_lines(tmp_path):
    """A Python without Loom: the engine exits before it is ready; the player is not left waiting for its
    start-up timeout (600 s here) while the bridge retries, but says why with the engine's last lines."""
    python = python_without_loom(tmp_path, honour_pythonpath=False)
    out = _play("-n", "5", "--size", "32x32", "-o", str(tmp_path / "x.mp4"), "--engine-python", str(python),
                "--startup-timeout", "600", timeout=120)
    assert out.returncode == 3, out.stderr
    assert f"loom play: error: the engine could not start: engine exited with code 1: {python}: Error while " \
           "finding module specification for 'loom_live.engine' (ModuleNotFoundError: No module named " \
           "'loom_live')" in out.stderr, out.stderr
    assert "engine log (last lines):" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(os.name == "nt", reason="the stand-in engine is a POSIX shell script")
@pytest.mark.parametrize("mode", ["lossless", "live"])
def test_an_engine_that_refuses_its_run_ends_the_player_with_exit_2_and_its_message_once(tmp_path, mode):
    """An engine that exits with code 2 (its config, its weights) is not restarted: the player says the
    engine's own error once and exits 2, and an existing output stays as it was."""
    engine = exiting_engine(tmp_path, 2, "preset 'wan2.1-1.3b' needs weights that are not here")
    dst = tmp_path / "kept.mp4"
    dst.write_bytes(b"yesterday's render")
    out = _play("-n", "5", "--size", "32x32", "--mode", mode, "-o", str(dst), "-y", "--engine-python", str(engine),
                "--startup-timeout", "60", timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("needs weights that are not here") == 1, out.stderr
    assert "loom play: error: preset 'wan2.1-1.3b' needs weights" in out.stderr and "Traceback" not in out.stderr
    assert dst.read_bytes() == b"yesterday's render" and not partial_path(dst).exists()


# --- live control: keyboard and OSC map to the same commands ------------------------------------


class RecordingBridge:
    def __init__(self) -> None:
        self.prompts: list[tuple[str, int | None]] = []
        self.params: list[dict] = []

    def set_prompt(self, text: str, transition_chunks: int | None = None) -> None:
        self.prompts.append((text, transition_chunks))

    def set_params(self, **kw) -> None:
        self.params.append(kw)

    def status(self):
        return SimpleNamespace(state="running", restarts=0)


def _controls(*prompts: str) -> Controls:
    return Controls(ControlState(prompts=list(prompts) or ["a", "b"]))


def test_before_a_served_engine_says_what_it_takes_no_parameter_is_sent():
    """A served engine's config is not this run's: a key pressed before it is ready sent -c's value stepped, which it
    may refuse by name, and the bridge told it again on ready. Refused until it says; then sent if it takes it."""
    controls, bridge = Controls(ControlState(prompts=["ink"], family=None, takes=frozenset())), RecordingBridge()
    controls.put(steps_command(1))
    assert controls.apply_pending(bridge) == ["steps: not sent: the served engine has not said yet which settings "
                                              "it takes; set it again once it runs"]
    assert bridge.params == [] and controls.state.steps == len(steps_for(2)) and controls.state.refused == 1
    assert controls.follow_engine({"prompt": "oil", "params": {"steps": [700, 500]}, "family": "wan"})
    controls.put(steps_command(1))
    controls.apply_pending(bridge)
    assert bridge.params == [{"steps": steps_for(1)}] and controls.state.takes == {"steps"}


def test_keys_change_steps_noise_prompt_and_quit():
    controls, bridge = _controls("ink", "oil"), RecordingBridge()
    controls.apply_pending(bridge)  # the engine runs: nothing to send yet
    keys = KeyboardInput(controls)
    for key in "3]]n":
        keys.press(ord(key))
    controls.apply_pending(bridge)
    assert bridge.params == [{"steps": steps_for(3), "noise_scale": 0.9}]  # one update per frame
    assert bridge.prompts == [("oil", None)]
    for key in "tneon\r":  # type a prompt, Enter sends it
        keys.press(ord(key))
    keys.press(27)  # Esc outside typing = quit
    controls.apply_pending(bridge)
    assert bridge.prompts[-1] == ("neon", None)
    assert controls.state.quit


def test_each_change_goes_to_the_bridge_once_whatever_the_engine_is_doing():
    """The bridge remembers what was set and tells a later or restarted engine (test_bridge.py):
    the controls hand each change over once, and never again."""
    controls, bridge = _controls("ink"), RecordingBridge()
    bridge.status = lambda: SimpleNamespace(state="starting", restarts=0)
    controls.put(Command("prompt", ("velvet", 4)))
    controls.put(steps_command(1))
    controls.apply_pending(bridge)
    assert bridge.prompts == [("velvet", 4)] and bridge.params == [{"steps": steps_for(1)}]
    bridge.status = lambda: SimpleNamespace(state="running", restarts=1)
    controls.apply_pending(bridge)
    assert len(bridge.prompts) == 1 and len(bridge.params) == 1


def test_prompts_sent_live_are_kept_up_to_a_bound_beside_the_runs_own_list():
    """A script sending a new prompt a second over OSC for a whole show must not grow the list (and every web
    page's state) without end: the oldest sent live goes, the --prompts list stays whole, n steps on."""
    from loom_live.plugin.player.controls import MAX_LIVE_PROMPTS

    controls, bridge = _controls("ink", "oil"), RecordingBridge()
    for i in range(MAX_LIVE_PROMPTS + 5):
        controls.put(Command("prompt", (f"line {i}", None)))
        controls.apply_pending(bridge)
    s = controls.state
    assert s.prompts[:2] == ["ink", "oil"] and len(s.prompts) == 2 + MAX_LIVE_PROMPTS
    assert s.prompts[2] == "line 5" and s.prompt == f"line {MAX_LIVE_PROMPTS + 4}"
    assert bridge.prompts[-1] == (f"line {MAX_LIVE_PROMPTS + 4}", None)
    controls.put(Command("prompt_next", ()))
    controls.apply_pending(bridge)
    assert s.prompt == "ink"


def test_typing_a_prompt_can_be_cancelled():
    controls, bridge = _controls(), RecordingBridge()
    keys = KeyboardInput(controls)
    for code in (13, ord("x"), 27):
        keys.press(code)
    controls.apply_pending(bridge)
    assert bridge.prompts == [] and not controls.state.quit and keys.typing is None


def test_osc_messages_map_to_commands_and_bad_ones_are_refused():
    assert command_for("/loom/steps", (1,)) == Command("steps", (1,))
    assert command_for("/loom/noise_scale", (0.5,)) == Command("noise_scale", (0.5,))
    assert command_for("/loom/prompt", ("glass", 2)) == Command("prompt", ("glass", 2))
    assert command_for("/loom/quit", ()) == Command("quit")
    for address, args, why in [("/loom/steps", (7,), "expected 1, 2, 3 or 4"),
                               ("/loom/noise_scale", (3.0,), r"noise_scale: .*expected a number in \[0.1, 1\]"),
                               ("/loom/prompt", ("",), "prompt is empty"),
                               ("/loom/bogus", (), "unknown OSC address"),
                               ("/loom/quit", (1, 2), "wrong arguments"),
                               ("/loom/prompt/index", (1.7,), "1.7 is not a whole number"),
                               ("/loom/prompt/index", (float("nan"),), "nan is not a whole number"),
                               ("/loom/motion_aware", (float("nan"),), r"expected no argument \(toggle\), or one of"),
                               ("/loom/pause", (b"\x01",), "is not allowed"),
                               ("/loom/pause", ("maybe",), "is not allowed"),
                               ("/loom/motion_aware", (1, 0), "is not allowed")]:
        with pytest.raises(ControlError, match=why):
            command_for(address, args)
    with pytest.raises(ControlError, match="empty; give an instruction, such as 'make it a watercolor painting'"):
        command_for("/loom/prompt", (" ",), "edit")  # an edit model's prompt is an instruction, not a style
    assert command_for("/loom/prompt", ("make it ink", 2), "edit") == Command("prompt", ("make it ink", 2))
    assert command_for("/loom/prompt/index", (2.0,)) == Command("prompt_index", (2,))
    assert command_for("/loom/pause", ()) == Command("pause", ())  # no argument: a toggle
    assert [command_for("/loom/motion_aware", (v,)).args for v in (True, 0, 1.0, "off", " ON ")] == \
        [(True,), (False,), (True,), (False,), (True,)]
    assert set(OSC_ADDRESSES) >= {"/loom/prompt", "/loom/steps", "/loom/noise_scale", "/loom/quit"}


def test_every_osc_refusal_names_the_address_sent_in_the_schema_s_words_and_a_key_s_keeps_its_own(tmp_path):
    """`/loom/control/scale 5` was refused as `context_scale: ...`, `/loom/lora/scale x 1.0` on an edit engine as
    `lora_scales: ... it takes adapter_strength, ...`, and a prompt index past the list without the `OSC refused` the
    others have. Refused as the message is read or when the frame loop applies it (a reference file read after the
    frame's other changes too), each is said as `OSC refused ADDRESS: ...`; the same refused from a key or the page
    keeps the words they share."""
    from loom_live.plugin.player.osc import refusal

    with pytest.raises(ControlError) as built:
        command_for("/loom/control/scale", (5,))
    assert refusal("/loom/control/scale", str(built.value)) == \
        "OSC refused /loom/control/scale: '5.0' is not allowed; expected a number in [0, 2]"
    takes = "it takes adapter_strength, noise_scale"
    controls = Controls(ControlState(prompts=["ink", "oil"], family="edit", lora_scales={"x": 1.0},
                                     control_sources=("edges",), takes=frozenset({"adapter_strength", "noise_scale"})))
    missing = tmp_path / "gone.png"
    for address, args in [("/loom/lora/scale", ("x", 1.0)), ("/loom/prompt/index", (7,)),
                          ("/loom/reference", (str(missing),))]:
        controls.put(command_for(address, args))
    controls.put(Command("lora_scale", ("x", 1.0)))  # a key's, or the page's
    assert controls.apply_pending(RecordingBridge()) == [
        f"OSC refused /loom/lora/scale: the engine's model (edit family) does not take it; {takes}",
        "OSC refused /loom/prompt/index: prompt index 7 out of range 0..1",
        f"OSC refused /loom/reference: {missing}: no such file; the reference stays",  # read after the rest
        f"lora_scales: the engine's model (edit family) does not take it; {takes}"]
    assert controls.state.refused == 4 and controls.state.prompt == "ink"


def test_osc_server_feeds_the_controls():
    pytest.importorskip("pythonosc", reason="OSC input needs the osc extra (python-osc)")
    from pythonosc.udp_client import SimpleUDPClient

    from loom_live.plugin.player.osc import OSCServer

    controls, bridge = Controls(ControlState(prompts=["ink"], family="edit")), RecordingBridge()
    controls.apply_pending(bridge)  # the engine runs: nothing to send yet
    server = OSCServer(controls, "127.0.0.1", 0)
    try:
        client = SimpleUDPClient(*server.address)
        client.send_message("/loom/prompt", ["chrome", 3])
        client.send_message("/loom/steps", 4)
        client.send_message("/loom/steps", 9)  # refused, counted
        client.send_message("/loom/steps", float("inf"))  # refused too (int() of it raises OverflowError)
        client.send_message("/loom/prompt", " ")  # refused in the words of the run's model family
        client.send_message("/loom/quit", [])
        deadline = time.monotonic() + 5
        while server.received < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
        said = controls.apply_pending(bridge)  # the frame loop prints these lines
    finally:
        server.close()
    assert bridge.prompts == [("chrome", 3)]
    assert bridge.params == [{"steps": steps_for(4)}]
    refusals = [line for line in said if line.startswith("OSC refused /loom/")]
    assert server.rejected == 3 and controls.state.refused == 3 and len(refusals) == 3
    for words in ("/loom/steps: 9 is not allowed; expected 1, 2, 3 or 4", "/loom/steps: inf is not a finite number",
                  "/loom/prompt: the prompt is empty; give an instruction"):
        assert sum(words in line for line in refusals) == 1, refusals  # in any order: a thread for each message
    assert controls.state.quit


def test_osc_quit_stops_a_live_run_and_finalises_the_output(tmp_path):
    pytest.importorskip("pythonosc", reason="OSC input needs the osc extra (python-osc)")
    from pythonosc.udp_client import SimpleUDPClient

    port = free_udp_port()
    dst = tmp_path / "osc.mp4"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "play", "--mode", "live", "--loop", "-n",
                             "100000", "--size", "64x64", "-o", str(dst), "--passthrough", "--osc-port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        partial = partial_path(dst)  # the output is written beside the target until it is finalised
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not partial.exists():
            time.sleep(0.1)
            assert proc.poll() is None, proc.communicate()[1]
        assert partial.exists() and not dst.exists()
        time.sleep(1.5)  # the live loop writes from its first frame on (fallback frames until the engine runs)
        client = SimpleUDPClient("127.0.0.1", port)
        client.send_message("/loom/prompt", ["neon city"])
        client.send_message("/loom/quit", [])
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert len(_decode(dst)) > 0


def test_what_the_running_engine_or_the_osc_server_refuses_is_said_in_the_terminal(tmp_path):
    """A live prompt the engine's embeddings file lacks is refused by the running engine, which stays
    running: the terminal says so in the engine's words (the command itself was said when sent). An OSC
    value out of range is refused by the player: said there too, not only in a window's overlay."""
    pytest.importorskip("pythonosc", reason="OSC input needs the osc extra (python-osc)")
    from pythonosc.udp_client import SimpleUDPClient

    from loom_live.engine.stream.prompts import HashTextEncoder
    from loom_live.plugin.cli.encode_prompts import write_embeddings

    embeddings = tmp_path / "show.safetensors"
    write_embeddings(HashTextEncoder(4096), ["ink wash"], embeddings)
    port = free_udp_port()
    cmd = [sys.executable, "-m", "loom_live.plugin.cli", "play", "--mode", "live", "--loop", "-n", "100000",
           "-c", "tiny-random", "--size", "32x32", "-o", str(tmp_path / "live.mp4"), "--osc-port", str(port),
           *sum((["--set", s] for s in ("resolution.width=32", "resolution.height=32", "stream.steps=[700]",
                                        "prompt.encoder=file", f"prompt.path={embeddings}",
                                        "prompt.text=ink wash")), [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()

    def said(words: str) -> bool:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if any(words in line for line in list(lines)):
                return True
            time.sleep(0.1)
        return False

    try:
        assert said("OSC control on udp://"), "".join(lines)
        client = SimpleUDPClient("127.0.0.1", port)
        client.send_message("/loom/prompt", ["watercolour"])
        client.send_message("/loom/steps", 9)
        assert said("has no embedding for prompt 'watercolour'"), "".join(lines)
        assert said("OSC refused /loom/steps: 9 is not allowed"), "".join(lines)
        client.send_message("/loom/quit", [])
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(5)
    assert proc.returncode == 0, "".join(lines)


@pytest.mark.skipif(not (shutil.which("Xvfb") and shutil.which("xdotool")),
                    reason="needs Xvfb and xdotool for a virtual display and key presses")
def test_window_keys_drive_a_live_run(tmp_path):
    """A real window on a virtual display: keys change steps and prompt, pause, and q quits cleanly."""
    display = f":{90 + os.getpid() % 100}"
    xvfb = subprocess.Popen(["Xvfb", display, "-screen", "0", "640x480x24"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    dst = tmp_path / "win.mp4"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DISPLAY": display}
    proc = None
    try:
        deadline = time.monotonic() + 30
        while not Path(f"/tmp/.X11-unix/X{display[1:]}").exists():  # the server is up when its socket is
            assert time.monotonic() < deadline and xvfb.poll() is None, "Xvfb did not start"
            time.sleep(0.1)
        proc = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "play", "-o", "window", "-o", str(dst),
                                 "--mode", "live", "--loop", "-n", "100000", "--size", "96x96", "--passthrough",
                                 "-p", "ink", "-p", "oil"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, cwd=ROOT)
        found = subprocess.run(["xdotool", "search", "--sync", "--onlyvisible", "--name", "^Loom$"],
                               capture_output=True, text=True, env=env, timeout=60)
        window = found.stdout.split()[0]
        time.sleep(1.0)  # the window is mapped; give its event loop a moment before typing

        def keys(*names: str) -> None:
            subprocess.run(["xdotool", "key", "--delay", "50", "--window", window, *names], env=env, check=True)
            time.sleep(0.5)

        keys("3", "n", "t", "g", "l", "o", "w", "Return")
        keys("q")
        _, err = proc.communicate(timeout=60)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        xvfb.terminate()
        xvfb.wait(timeout=10)
    assert proc.returncode == 0, err
    assert "steps: 3" in err and "prompt: oil" in err and "prompt: glow" in err
    assert len(_decode(dst)) > 0


def _clip_with_audio(path: Path, n: int = 25, fps: int = 25, size: int = 64) -> None:
    import av

    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264" if "libx264" in av.codecs_available else "h264", rate=fps)
        video.width = video.height = size
        video.pix_fmt = "yuv420p"
        audio = out.add_stream("aac", rate=44100, layout="mono")
        for i in range(n):
            img = np.full((size, size, 3), (i * 9) % 256, np.uint8)
            out.mux(video.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        tone = (0.2 * np.sin(2 * np.pi * 440 * np.arange(44100 * n // fps) / 44100)).astype(np.float32)
        for start in range(0, len(tone), 1024):
            frame = av.AudioFrame.from_ndarray(tone[None, start:start + 1024], format="fltp", layout="mono")
            frame.sample_rate = 44100
            out.mux(audio.encode(frame))
        out.mux(video.encode(None))
        out.mux(audio.encode(None))


def test_audio_of_a_file_input_passes_through_to_the_file_output(tmp_path):
    import av

    src, dst = tmp_path / "with_audio.mp4", tmp_path / "out.mp4"
    _clip_with_audio(src)
    out = _play("-i", str(src), "-o", str(dst), "--passthrough")
    assert out.returncode == 0, out.stderr
    with av.open(str(dst)) as c:
        assert c.streams.audio, "the output lost the audio track"
        seconds = sum(f.samples for f in c.decode(audio=0)) / c.streams.audio[0].rate
    assert 0.8 < seconds < 1.2  # one second of video, one second of sound
    assert len(_decode(dst)) == 25


# --- faults on stage: damaged input, a stream that stops, outputs, signals ---------------------


def test_a_file_damaged_mid_stream_plays_on_past_the_damage(tmp_path):
    src, dst = damage_middle(noise_clip(tmp_path / "damaged.mp4", 60)), tmp_path / "out.mkv"
    out = _play("-i", str(src), "-o", str(dst), "--passthrough")
    assert out.returncode == 0, out.stderr
    assert "damaged" in out.stderr and "Traceback" not in out.stderr
    assert len(_decode(dst)) >= 50, "the run stopped at the damage"


def test_a_stream_that_stops_keeps_every_frame_read_before_it(tmp_path):
    """A lossless run of a TCP stream that goes silent: the frames that came before are all written."""
    n = 36  # one first batch (21) and part of the next: the part used to be lost
    clip = noise_clip(tmp_path / "feed.ts", n).read_bytes()
    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(clip)
            stop.wait(60)  # connected but silent, as a stalled camera feed

    threading.Thread(target=serve, daemon=True).start()
    dst = tmp_path / "out.mkv"
    try:
        out = _play("-i", f"tcp://127.0.0.1:{server.getsockname()[1]}", "--mode", "lossless", "-o", str(dst),
                    "--passthrough", timeout=60)
    finally:
        stop.set()
        server.close()
    assert out.returncode == 2, out.stderr
    assert "no data for 5 s" in out.stderr and "Traceback" not in out.stderr
    assert len(_decode(dst)) >= n - 2, "frames read before the stall were dropped"


def test_sigterm_finalises_the_file_and_leaves_nothing_behind(tmp_path):
    """What a process manager sends (SIGHUP from a closed terminal takes the same path): the recording
    still plays, the engine process is gone and no shared-memory segment is left."""
    signum = signal.SIGTERM
    dst = tmp_path / "stopped.mp4"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "play", "-n", "100000", "--size", "32x32",
                             "-o", str(dst), "--passthrough"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    try:
        for line in proc.stderr:  # the first progress line: frames are being written
            if "/100000 [" in line:  # tqdm's format: done/total [elapsed<eta, rate]
                break
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    assert f"stopped by {signal.Signals(signum).name}" in err and "Traceback" not in err
    frames = _decode(dst)  # without the handler Python died on the spot: an MP4 without its index
    assert len(frames) > 0 and frames.shape[1:] == (32, 32, 3)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], "the engine outlived the player"
    assert not list(Path("/dev/shm").glob(f"loom_{proc.pid}_*")), "shared memory left behind"


def test_a_stop_signal_while_the_player_waits_on_a_frozen_engine_ends_the_run_at_once(tmp_path):
    """SIGTERM while the main thread waits inside the bridge (the engine frozen, every slot in flight): it is not
    raised into the bridge's code, whose locks it could leave held, and the run does not wait out the engine's stall
    timeout either: the bridge's wait ends, and the run ends as stopped, its recording finalised."""
    dst = tmp_path / "frozen.mp4"
    proc = _file_run(dst, 100000, "32x32")
    engine = None
    try:
        _wait_writing(proc, dst, 1_000)
        engine = int(subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()[0])
        os.kill(engine, signal.SIGSTOP)
        time.sleep(0.3)  # the slots in flight: the player waits in the bridge for one to come back
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        if engine is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    assert len(_decode(dst)) > 0
    assert took < 30, f"the stop took {took:.1f} s: it waited on the frozen engine"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) to fill a disk")
def test_a_recording_that_could_not_be_finished_is_an_error_not_a_success(tmp_path):
    """A full recording drive: the run says so and exits with 2; the other output is complete."""
    full, good = tmp_path / "full.mkv", tmp_path / "good.mkv"
    partial_path(full).symlink_to("/dev/full")  # every write fails with ENOSPC
    out = _play("-n", "30", "--size", "64x64", "-o", str(full), "-o", str(good), "--passthrough")
    assert out.returncode == 2, out.stderr
    assert "full.mkv: finishing the output failed: No space left on device" in out.stderr
    assert not full.exists(), "an output that could not be finished is not put in place"
    assert "Traceback" not in out.stderr
    assert len(_decode(good)) == 30


def test_an_input_that_changes_size_mid_stream_stays_whole_in_the_output(tmp_path):
    """Two MPEG-TS segments back to back (a stream switched to another camera): 64x48 grey, then
    128x96 white on the left and black on the right. The output keeps 64x48 and shows the whole
    second picture scaled, not its top-left corner."""
    grey = np.full((48, 64, 3), 128, np.uint8)
    halves = np.zeros((96, 128, 3), np.uint8)
    halves[:, :64] = 255
    first = write_clip(tmp_path / "a.ts", [grey] * 12).read_bytes()
    second = write_clip(tmp_path / "b.ts", [halves] * 12).read_bytes()
    src, dst = tmp_path / "switched.ts", tmp_path / "out.mkv"
    src.write_bytes(first + second)
    out = _play("-i", str(src), "-o", str(dst), "--passthrough")
    assert out.returncode == 0, out.stderr
    assert "changed size to 128x96" in out.stderr
    frames = _decode(dst)
    assert frames.shape == (24, 48, 64, 3)
    after = frames[12:].astype(np.float32)
    assert after[:, :, 4:28].mean() > 200 and after[:, :, 36:60].mean() < 55, "the picture was cropped"


def test_a_live_stream_that_stalls_holds_the_picture_and_reconnects(tmp_path):
    """A TCP MPEG-TS feed sends dark frames, goes silent (past the 5 s read timeout), and comes back
    with bright frames on a new connection: the run goes on, every output keeps getting frames (the
    last picture, held) during the stall, and the new feed reaches the output."""
    dark = write_clip(tmp_path / "dark.ts", [np.zeros((48, 64, 3), np.uint8)] * 24).read_bytes()
    bright = write_clip(tmp_path / "bright.ts", [np.full((48, 64, 3), 255, np.uint8)] * 24).read_bytes()
    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))

    def send_paced(conn: socket.socket, clip: bytes) -> None:
        step = len(clip) // 24 + 1  # about a frame's worth of bytes every 1/24 s
        for i in range(0, len(clip), step):
            conn.sendall(clip[i:i + step])
            time.sleep(1 / 24)

    def stall(conn: socket.socket) -> None:
        with conn:
            send_paced(conn, dark)
            stop.wait(60)  # connected but silent until the test ends: only the player's timeout notices

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            threading.Thread(target=stall, args=(conn,), daemon=True).start()
            while not stop.is_set():  # the feed is back: each new connection gets it
                conn, _ = server.accept()
                with conn, contextlib.suppress(OSError):
                    while not stop.is_set():
                        send_paced(conn, bright)

    threading.Thread(target=serve, daemon=True).start()
    dst = tmp_path / "show.mkv"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "play", "-i", f"tcp://127.0.0.1:{server.getsockname()[1]}",
                             "-o", str(dst), "--passthrough"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    seen, back_at = [], None
    try:
        for line in proc.stderr:  # until the feed has been back for a while (status lines come every 2 s)
            seen.append(line)
            if "input reconnected" in line:
                back_at = time.monotonic()
            if back_at is not None and line.startswith("live") and time.monotonic() - back_at > 1.5:
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        stop.set()
        server.close()
        if proc.poll() is None:
            proc.kill()
    err = "".join(seen) + err
    assert proc.returncode == 143, err
    assert "input lost" in err and "no data for 5 s" in err and "Traceback" not in err
    assert "input stalled" in err  # the status line says so while it lasts
    means = _decode(dst).reshape(-1, 48 * 64 * 3).mean(axis=1)
    assert (means < 30).sum() >= 48, "during the stall the outputs got no frames (>= 2 s of held picture expected)"
    assert means[-1] > 220, "the reconnected feed did not reach the output"


def test_an_output_that_fails_mid_run_stops_alone_and_the_others_go_on(tmp_path):
    """A recorder that goes away mid-set (here the reader of a FIFO closes it: EPIPE), as a streaming
    server can: that output is reported and stopped; the other output still gets every frame."""
    fifo, broken, kept = tmp_path / "fifo", tmp_path / "broken.mkv", tmp_path / "kept.mkv"
    os.mkfifo(fifo)
    partial_path(broken).symlink_to(fifo)  # the file is written under this name until it is finalised

    def read_a_little() -> None:
        with open(fifo, "rb") as f:
            f.read(1000)

    threading.Thread(target=read_a_little, daemon=True).start()
    out = _play("-n", "200", "--size", "64x64", "-o", str(broken), "-o", str(kept), "--passthrough")
    assert out.returncode == 2, out.stderr
    assert "broken.mkv: writing failed" in out.stderr and "the others go on" in out.stderr
    assert "Traceback" not in out.stderr
    assert len(_decode(kept)) == 200, "the failure of one output cut the other short"


def test_a_file_run_whose_only_output_fails_ends_at_once_with_the_outputs_error(tmp_path):
    """The one recording of a file run goes away (EPIPE): the run ends there with the output's error, not
    "the engine stopped" and a render of every remaining frame to nowhere."""
    fifo, broken = tmp_path / "fifo", tmp_path / "broken.mkv"
    os.mkfifo(fifo)
    partial_path(broken).symlink_to(fifo)

    def read_a_little() -> None:
        with open(fifo, "rb") as f:
            f.read(1000)

    threading.Thread(target=read_a_little, daemon=True).start()
    out = _play("-n", "200", "--size", "64x64", "-o", str(broken), "--passthrough")
    assert out.returncode == 2, out.stderr
    assert "error: output: " in out.stderr and "broken.mkv: writing failed" in out.stderr, out.stderr
    assert "the engine stopped" not in out.stderr and "to no output" not in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not broken.exists()


def test_hold_cpu_awake_is_said_held_or_why_not_and_the_run_goes_on(tmp_path):
    """`--hold-cpu-awake` says, once, whether the CPUs are held out of deep idle states (root on Linux) or why not
    (another system, no permission), and the run is the same either way."""
    out = tmp_path / "held.mp4"
    proc = _play("--passthrough", "-n", "5", "--size", "32x32", "--hold-cpu-awake", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "idle states" in line]
    with CpuAwake() as here:  # what this machine allows
        expected = "CPUs held out of deep idle states while the show runs" if here.held else \
            f"--hold-cpu-awake: {here.why}"
    assert said == [f"loom play: {expected}"], proc.stderr
    assert _decode(out).shape == (5, 32, 32, 3)
