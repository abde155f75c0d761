"""Video I/O: real clips, files written and read back, a UDP stream, audio pass-through, bad inputs."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import av
import numpy as np
import pytest

from loom_live.plugin.media.base import DEFAULT_OPEN_TIMEOUT_S, MediaError
from loom_live.plugin.media.generated_clip import generate_clip
from loom_live.plugin.media.network_output import NETWORK_QUEUE_FRAMES
from loom_live.plugin.media.partial_files import aside_path, partial_path
from loom_live.plugin.media.sinks import FrameSink, check_output_file, open_sink
from loom_live.plugin.media.sources import open_source
from loom_live.plugin.media.stop_signals import signals_deferred
from tests.fakes.media import damage_middle, free_udp_port, noise_clip, open_when_listening, rtmp_server

REPO = Path(__file__).resolve().parents[2]


def _port_listed(port: int) -> bool:
    """Linux lists bound UDP sockets in /proc/net/udp (FFmpeg may bind with SO_REUSEADDR, which a
    bind probe cannot see)."""
    try:
        rows = Path("/proc/net/udp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(row.split()[1].endswith(f":{port:04X}") for row in rows)


def _wait_until_bound(port: int, timeout_s: float = 20.0) -> None:
    """Wait until someone (the PyAV reader) holds the UDP port."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _port_listed(port):
            return
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return
        time.sleep(0.02)
    raise AssertionError(f"the reader never bound udp port {port}")


def _make_clip_with_audio(path: Path, audio_codec: str, video_s: float, audio_s: float) -> None:
    """A small clip (h264 video + a 440 Hz tone) written with PyAV, audio longer than video."""
    fps, rate, width, height = 24, 48000, 64, 48
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = out.add_stream(audio_codec, rate=rate, layout="stereo")
        for i in range(round(video_s * fps)):
            frame = av.VideoFrame.from_ndarray(np.full((height, width, 3), 8 * i, np.uint8), format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
        tone = (np.sin(2 * np.pi * 440 * np.arange(round(audio_s * rate)) / rate) * 8000).astype(np.int16)
        for start in range(0, len(tone), 1024):
            chunk = tone[start:start + 1024]
            packed = np.repeat(chunk, 2)[None, :]  # interleaved stereo s16
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(packed), format="s16", layout="stereo")
            frame.sample_rate, frame.pts = rate, start
            out.mux(audio.encode(frame))
        out.mux(audio.encode(None))


def _stream_summary(path: Path) -> dict[str, tuple[str, float]]:
    """Codec name and decoded duration (seconds) per stream type."""
    summary = {}
    for kind in ("video", "audio"):
        with av.open(str(path)) as c:
            streams = getattr(c.streams, kind)
            if not streams:
                continue
            last = 0.0
            for frame in c.decode(streams[0]):
                duration = frame.samples / frame.sample_rate if kind == "audio" else 0.0
                last = max(last, frame.time + duration)
            summary[kind] = (streams[0].codec_context.name, last)
    return summary


def test_reads_real_clip(media_dir: Path) -> None:
    with open_source(media_dir / "davis512_blackswan.mp4") as src:
        assert (src.width, src.height, src.fps, src.frame_count, src.is_live) == (512, 512, 24.0, 50, False)
        frames = list(src)
    assert len(frames) == 50
    assert all(f.shape == (512, 512, 3) and f.dtype == np.uint8 for f in frames)
    assert frames[0].std() > 10 and np.abs(frames[0].astype(int) - frames[-1]).mean() > 1


def test_reads_non_square_clip_as_rows_by_columns(media_dir: Path) -> None:
    with open_source(str(media_dir / "sdv2_original_832x480.mp4")) as src:
        assert src.size == (832, 480) and src.fps == 16.0
        assert src.read().shape == (480, 832, 3)


@pytest.mark.skipif(not hasattr(av.video.stream.VideoStream, "set_display_rotation"),
                    reason="writing a display rotation needs a PyAV with set_display_rotation")
def test_a_clip_with_a_display_rotation_is_read_upright(tmp_path: Path) -> None:
    """A phone's portrait clip: stored 64x48 with a 90 degree display rotation, shown 48x64 by players."""
    path = tmp_path / "portrait.mp4"
    stored = np.zeros((48, 64, 3), np.uint8)
    stored[:16, :16] = 255  # top-left as stored: bottom-left once turned 90 degrees counter-clockwise
    with av.open(str(path), "w") as out:
        video = out.add_stream("libx264", rate=24)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        video.set_display_rotation(90)
        for i in range(3):
            frame = av.VideoFrame.from_ndarray(stored, format="rgb24")
            frame.pts = i
            out.mux(video.encode(frame))
        out.mux(video.encode(None))
    with open_source(path) as src:
        assert src.size == (48, 64)
        frames = list(src)
    assert len(frames) == 3 and all(f.shape == (64, 48, 3) for f in frames)
    assert frames[0][-12:, :12].mean() > 200 and frames[0][:12, :12].mean() < 50


def test_generated_clip_is_deterministic_and_moves() -> None:
    a = np.stack(list(generate_clip(6, (96, 64), 24, seed=3)))
    b = np.stack(list(generate_clip(6, (96, 64), 24, seed=3)))
    c = np.stack(list(generate_clip(6, (96, 64), 24, seed=4)))
    assert a.shape == (6, 64, 96, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert all(np.abs(a[i + 1].astype(int) - a[i]).mean() > 0.5 for i in range(5))


@pytest.mark.parametrize("suffix", [".mp4", ".mkv", ".mov"])
def test_file_written_reads_back(tmp_path: Path, suffix: str) -> None:
    frames = list(generate_clip(20, (96, 64), 24, seed=1))
    path = tmp_path / f"out{suffix}"
    with open_sink(path, 24, (96, 64)) as sink:
        for frame in frames:
            sink.write(frame)
        assert sink.frames_written == 20
    with open_source(path) as src:
        assert src.size == (96, 64) and src.fps == pytest.approx(24.0)
        assert src.frame_count == 20 and not src.is_live
        back = list(src)
    assert len(back) == 20
    error = np.abs(np.stack(back).astype(np.float32) - np.stack(frames)).mean()
    assert error < 6.0, f"decoded frames differ from what was written (mean abs diff {error:.1f})"


def test_udp_mpegts_sink_reaches_a_pyav_reader() -> None:
    port = free_udp_port()
    received: list[np.ndarray] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            with av.open(f"udp://127.0.0.1:{port}", format="mpegts", timeout=(10.0, 1.5)) as c:
                for frame in c.decode(video=0):
                    received.append(frame.to_ndarray(format="rgb24"))
        except av.error.ExitError:
            pass  # read timeout: the sender stopped
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            errors.append(e)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    _wait_until_bound(port)
    frames = list(generate_clip(48, (160, 96), 24, seed=2))
    with open_sink(f"udp://127.0.0.1:{port}", 24, (160, 96)) as sink:
        assert sink.is_network
        for frame in frames:
            sink.write(frame)
            time.sleep(0.004)
    thread.join(timeout=20)
    assert not errors, errors
    assert len(received) >= 40, f"only {len(received)} of 48 frames arrived"
    assert received[0].shape == (96, 160, 3)
    assert np.abs(received[-1].astype(np.float32) - frames[-1]).mean() < 10.0


def test_missing_file() -> None:
    with pytest.raises(MediaError, match="video file not found: .*nope.mp4"):
        open_source("/definitely/nope.mp4")


def test_text_file_named_mp4(tmp_path: Path) -> None:
    fake = tmp_path / "fake.mp4"
    fake.write_text("this is not a video\n" * 50)
    with pytest.raises(MediaError, match="fake.mp4: not a readable video"):
        open_source(fake)


def test_folder_is_not_a_video(tmp_path: Path) -> None:
    with pytest.raises(MediaError, match="is a directory"):
        open_source(tmp_path)


def test_a_pipe_is_refused_at_once_as_not_a_regular_file(tmp_path: Path) -> None:
    """Opening a FIFO with no writer blocks in the kernel, beyond the open timeout: refused by its kind."""
    fifo = tmp_path / "feed"
    os.mkfifo(fifo)
    with pytest.raises(MediaError, match=r"feed is not a regular file \(a pipe or a device\); expected a video file"):
        open_source(fifo)


@pytest.mark.parametrize("spec", [99, "99"])
def test_camera_that_does_not_open(spec: int | str) -> None:
    with pytest.raises(MediaError, match="camera 99 could not be opened"):
        open_source(spec)


def test_bad_url_scheme() -> None:
    with pytest.raises(MediaError, match="unsupported URL scheme 'foo'.*allowed: rtsp"):
        open_source("foo://example/stream")


def test_unreachable_url_fails_fast() -> None:
    with socket.socket() as s:  # a port that is certainly closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MediaError, match=f"rtsp://127.0.0.1:{port}/live: cannot open"):
        open_source(f"rtsp://127.0.0.1:{port}/live")


def test_srt_without_a_peer_or_without_support_is_a_clear_error() -> None:
    """This PyAV build may lack SRT (libsrt); either way the message names the URL and the reason."""
    port = free_udp_port()
    pattern = rf"srt://127\.0\.0\.1:{port}: (this FFmpeg build .* does not support|cannot|no answer)"
    with pytest.raises(MediaError, match=pattern):
        open_source(f"srt://127.0.0.1:{port}", open_timeout=1.0)
    with pytest.raises(MediaError, match=pattern):
        open_sink(f"srt://127.0.0.1:{port}", 24, (64, 48))


def test_silent_stream_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(MediaError, match="no answer within 1 s"):
        open_source(f"udp://127.0.0.1:{free_udp_port()}", open_timeout=1.0)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(("spec", "size", "message"), [
    ("out.avi", (64, 48), "must end in one of .mp4, .mkv, .mov"),
    ("out.mp4", (65, 48), "even width and height"),
    ("ftp://host/x", (64, 48), "unsupported output URL scheme 'ftp'"),
    ("missing_dir/out.mp4", (64, 48), "output folder does not exist"),
    # no port: FFmpeg opened these and sent nothing, and the run failed 5 s in, saying the receiver took nothing
    ("udp://127.0.0.1", (64, 48), r"udp://127.0.0.1: expected udp://HOST:PORT with a port of 1 to 65535"),
    ("udp://127.0.0.1:0", (64, 48), "expected udp://HOST:PORT"),
    ("srt://127.0.0.1", (64, 48), "expected srt://HOST:PORT"),
])
def test_bad_sinks(tmp_path: Path, spec: str, size: tuple[int, int], message: str) -> None:
    target = spec if "://" in spec else tmp_path / spec
    with pytest.raises(MediaError, match=message):
        open_sink(target, 24, size)


# the largest sizes of three shapes that H.264 takes, each beside the smallest one past it
H264_EDGES = [((16384, 16128), (16384, 16130)), ((16254, 16254), (16256, 16256)), ((2, 16384), (2, 16386))]


def test_a_picture_larger_than_h264_takes_is_refused_naming_its_size_the_limit_and_a_size_that_fits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`loom play --size 20000x20000` failed to start its output with "Invalid argument", naming neither the size nor
    the limit. It is refused with both, and a --size of its shape that fits; the limit is the encoder's own: what
    it opens is taken, and what is refused past it, the encoder refuses too (opened only: no frame is made)."""
    import loom_live.plugin.media.sinks as sinks

    for fits, too_big in H264_EDGES:
        open_sink(tmp_path / "fits.mp4", 24, fits).close()
        with pytest.raises(MediaError, match=f"{too_big[0]}x{too_big[1]} is larger than H.264 takes"):
            open_sink(tmp_path / "big.mp4", 24, too_big)
    with pytest.raises(MediaError) as refused:
        open_sink(tmp_path / "big.mp4", 24, (20000, 20000))
    assert str(refused.value) == (f"{tmp_path / 'big.mp4'}: 20000x20000 is larger than H.264 takes (at most 16384 px "
                                  "a side, and 16254x16254 for a square); give --size 16254x16254 or smaller")
    monkeypatch.setattr(sinks, "_h264_takes", lambda width, height: True)  # the encoder's word past the limit
    for _, too_big in H264_EDGES:
        with pytest.raises(MediaError, match="cannot start the output"):
            open_sink(tmp_path / "big.mp4", 24, too_big)
    assert list(tmp_path.iterdir()) == [], "an output opened without frames left a file"


def test_sink_refuses_wrong_frames(tmp_path: Path) -> None:
    with open_sink(tmp_path / "out.mp4", 24, (64, 48)) as sink:
        with pytest.raises(MediaError, match=r"frame shape must be \(48, 64, 3\)"):
            sink.write(np.zeros((64, 48, 3), np.uint8))
        with pytest.raises(MediaError, match="must be uint8"):
            sink.write(np.zeros((48, 64, 3), np.float32))


@pytest.mark.parametrize(("audio_codec", "expected"), [("aac", "aac"), ("pcm_s16le", "aac")])
def test_audio_passes_through_to_a_file(tmp_path: Path, audio_codec: str, expected: str) -> None:
    """AAC is copied as is; PCM (poorly supported in MP4) is re-encoded to AAC; cut at the video end."""
    source = tmp_path / "with_audio.mkv"
    _make_clip_with_audio(source, audio_codec, video_s=1.0, audio_s=2.0)
    with open_source(source) as src:
        frames = list(src)[:12]  # stop after half a second, like a run ended early
    out = tmp_path / "out.mp4"
    with open_sink(out, 24, (64, 48), audio_from=source) as sink:
        for frame in frames:
            sink.write(frame)
    summary = _stream_summary(out)
    assert summary["audio"][0] == expected
    assert summary["audio"][1] == pytest.approx(0.5, abs=0.05)
    with open_source(out) as back:
        assert len(list(back)) == 12


def test_audio_source_without_audio_is_fine(tmp_path: Path) -> None:
    silent = tmp_path / "silent.mp4"
    with open_sink(silent, 24, (64, 48)) as sink:
        sink.write(np.zeros((48, 64, 3), np.uint8))
    out = tmp_path / "out.mkv"
    with open_sink(out, 24, (64, 48), audio_from=silent) as sink:
        sink.write(np.zeros((48, 64, 3), np.uint8))
    assert "audio" not in _stream_summary(out)


def test_file_is_finalised_after_ctrl_c(tmp_path: Path) -> None:
    out = tmp_path / "interrupted.mp4"
    script = textwrap.dedent(f"""
        import sys, numpy as np
        from loom_live.plugin.media.generated_clip import generate_clip
        from loom_live.plugin.media.sinks import open_sink
        clip = generate_clip(10, (96, 64), 24, seed=0)
        with open_sink({str(out)!r}, 24, (96, 64)) as sink:
            for i in range(10**6):
                sink.write(clip.frame(i))
                if i == 10:
                    print("writing", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert "KeyboardInterrupt" in stderr
    with open_source(out) as src:
        assert src.size == (96, 64)
        assert len(list(src)) > 10


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_during_an_encode_keeps_its_packets_and_the_file_plays(tmp_path: Path, signame: str) -> None:
    """Ctrl-C (or a stop signal the player turns into an exception) that lands while the encoder runs is
    raised as soon as the encode returns: before the packets it returned were written, the first keyframe
    among them, the kept file would play nothing. Sent from inside the first encode that returns packets."""
    out = tmp_path / "stopped.mp4"
    script = textwrap.dedent(f"""
        import os, signal
        from loom_live.plugin.media.generated_clip import generate_clip
        from loom_live.plugin.media.sinks import open_sink

        class Stop(BaseException):
            pass

        def stop(signum, frame):
            raise Stop()

        if {signame!r} == "SIGTERM":
            signal.signal(signal.SIGTERM, stop)  # as the player does

        class SignalInEncode:
            def __init__(self, stream):
                self.stream, self.fired = stream, False

            def encode(self, frame):
                packets = self.stream.encode(frame)
                if packets and not self.fired:
                    self.fired = True
                    os.kill(os.getpid(), signal.{signame})
                return packets

            def __getattr__(self, name):
                return getattr(self.stream, name)

        clip = generate_clip(60, (96, 64), 24, seed=0)
        sink = open_sink({str(out)!r}, 24, (96, 64))
        sink._video = SignalInEncode(sink._video)
        try:
            for i in range(60):
                sink.write(clip.frame(i))
        except (KeyboardInterrupt, Stop):
            print("stopped after", sink.frames_written, flush=True)
        finally:
            sink.close(keep=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    written = int(result.stdout.split()[-1])
    assert result.stdout.startswith("stopped after") and 0 < written < 60, result.stderr
    with open_source(out) as src:
        assert len(list(src)) == written  # every frame written plays, the first keyframe among them


def test_importing_host_bridge_needs_no_av_cv2_or_torch() -> None:
    code = ("import sys, loom_live.plugin.media.sources, loom_live.plugin.media.sinks, "
            "loom_live.plugin.media.generated_clip; "
            "print(sorted(m for m in ('av', 'cv2', 'torch', 'loom_live.engine') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_damaged_packets_mid_file_are_skipped_and_the_rest_is_read(tmp_path: Path) -> None:
    with open_source(damage_middle(noise_clip(tmp_path / "damaged.mp4", 60))) as src:
        frames = list(src)
        assert src.skipped_packets >= 1, "the damage should reach the decoder (else this test tests nothing)"
    assert len(frames) >= 50, f"reading stopped at the damage: {len(frames)} of 60 frames"
    assert all(f.shape == (48, 64, 3) for f in frames)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux) to fill a disk")
def test_a_full_disk_is_reported_when_the_file_cannot_be_finished(tmp_path: Path) -> None:
    """FFmpeg buffers its writes, so a full disk often shows only at close: it must be a MediaError there."""
    full = tmp_path / "full.mkv"
    full.write_bytes(b"an earlier recording")
    # The file is written under its partial name first: that one is the full drive (every write fails
    # with ENOSPC, as on a full recording drive).
    partial_path(full).symlink_to("/dev/full")
    sink = open_sink(full, 24, (64, 48))
    for i in range(5):
        sink.write(np.full((48, 64, 3), i * 40, np.uint8))
    with pytest.raises(MediaError, match="full.mkv: finishing the output failed: No space left on device"):
        sink.close()
    assert full.read_bytes() == b"an earlier recording", "a failed output must leave the target as it was"
    assert not partial_path(full).exists()


def test_a_file_appears_only_when_finished_and_a_discarded_one_leaves_the_target(tmp_path: Path) -> None:
    out = tmp_path / "out.mp4"
    out.write_bytes(b"mine")
    sink = open_sink(out, 24, (64, 48))
    sink.write(np.zeros((48, 64, 3), np.uint8))
    assert out.read_bytes() == b"mine" and partial_path(out).exists()
    sink.discard()
    assert out.read_bytes() == b"mine" and not partial_path(out).exists()
    empty = open_sink(out, 24, (64, 48))
    empty.close()  # no frame: nothing playable to put in place
    assert out.read_bytes() == b"mine"
    with open_sink(out, 24, (64, 48)) as sink:
        sink.write(np.zeros((48, 64, 3), np.uint8))
    assert out.read_bytes() != b"mine" and list(tmp_path.iterdir()) == [out]


@pytest.mark.skipif(sys.platform == "win32", reason="the partial is locked with flock (POSIX)")
def test_a_second_writer_of_the_same_output_is_refused_while_the_first_writes(tmp_path: Path) -> None:
    """Two runs writing one output shared its partial: the first to finish moved a mix of both onto the target
    (undecodable) and the other's recording was lost. The second is refused at open, naming the output; once the
    first has finished, or from a partial a killed run left (no lock), a new one writes as usual."""
    out = tmp_path / "set.mp4"
    first = open_sink(out, 24, (64, 48))
    first.write(np.zeros((48, 64, 3), np.uint8))
    with pytest.raises(MediaError, match="set.mp4: another run is writing this file now"):
        open_sink(out, 24, (64, 48), overwrite=True)
    for i in range(4):
        first.write(np.full((48, 64, 3), i * 60, np.uint8))
    first.close()
    with open_source(out) as src:
        assert len(list(src)) == 5
    partial_path(out).write_bytes(b"left by a killed run")
    with open_sink(out, 24, (64, 48), overwrite=True) as again:
        again.write(np.zeros((48, 64, 3), np.uint8))
    with open_source(out) as src:
        assert len(list(src)) == 1
    assert sorted(tmp_path.iterdir()) == [out]


def test_a_partial_that_cannot_be_moved_or_removed_is_named_in_the_error(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording drive gone read-only mid-run: the finished file cannot be moved into place, nor removed. The
    error says where the hidden file is, rather than leave it there unsaid."""
    out = tmp_path / "set.mp4"
    sink = open_sink(out, 24, (64, 48))
    sink.write(np.zeros((48, 64, 3), np.uint8))

    def read_only(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    with monkeypatch.context() as m:
        m.setattr(os, "replace", read_only)
        m.setattr(Path, "unlink", read_only)
        with pytest.raises(MediaError) as caught:
            sink.close()
    assert str(caught.value) == (f"{out}: cannot move the finished file into place: Read-only file system; "
                                 f"{partial_path(out)} is left behind (removing it failed too)")
    assert partial_path(out).exists() and not out.exists()



def test_a_discarded_file_whose_partial_cannot_be_removed_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """The player's path for a failed output: a drive gone read-only leaves the hidden partial. It is logged,
    and named in what discard() returns for the output's failure line, not left there unsaid."""
    out = tmp_path / "set.mp4"
    sink = open_sink(out, 24, (64, 48))
    sink.write(np.zeros((48, 64, 3), np.uint8))

    def read_only(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    with monkeypatch.context() as m, caplog.at_level("WARNING", logger="loom_live.plugin.media.sinks"):
        m.setattr(Path, "unlink", read_only)
        left = sink.discard()
    assert left == f"; {partial_path(out)} is left behind (removing it failed too)"
    assert f"cannot remove the unfinished file {partial_path(out)}: Read-only file system" in caplog.text
    assert partial_path(out).exists() and not out.exists()
    assert sink.discard() == left  # said again to a second caller, not lost


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_file_made_at_the_target_during_the_run_is_never_replaced_without_overwrite(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, hard_links: bool) -> None:
    """Without -y an existing output is refused at open, but one someone saved there during the run was replaced
    when the run finished. It is left as it was, and the run's file goes beside it under the first free name, said
    in what the run reports (once: not in the log too); on a drive without hard links (FAT) too."""
    if not hard_links:
        def no_links(*_args: object, **_kwargs: object) -> None:
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))

        monkeypatch.setattr(os, "link", no_links)
    out = tmp_path / "set.mp4"
    sink = open_sink(out, 24, (64, 48), overwrite=False)
    for i in range(3):
        sink.write(np.full((48, 64, 3), i * 60, np.uint8))
    out.write_bytes(b"saved during the run")
    aside_path(out, 1).write_bytes(b"saved before")
    with caplog.at_level("DEBUG", logger="loom_live.plugin.media.sinks"):
        sink.close()
    mine = aside_path(out, 2)
    assert out.read_bytes() == b"saved during the run" and aside_path(out, 1).read_bytes() == b"saved before"
    with open_source(mine) as src:
        assert len(list(src)) == 3
    assert sink.kept and sink.kept_at == mine
    assert sink.written_to == f"{mine} ({out} appeared during the run and was left as it was)"
    assert caplog.text == ""
    assert sorted(tmp_path.iterdir()) == sorted([out, aside_path(out, 1), mine]), "a partial was left behind"


def test_a_new_target_is_written_without_overwrite_and_one_made_meanwhile_is_replaced_with_it(tmp_path: Path) -> None:
    """The other side of the same rule: a free target takes the file under its own name, and with -y a file
    saved there during the run is replaced, as the user asked."""
    out = tmp_path / "set.mp4"
    with open_sink(out, 24, (64, 48), overwrite=False) as sink:
        sink.write(np.zeros((48, 64, 3), np.uint8))
    assert sink.kept_at == out and sink.written_to == str(out)
    replaced = tmp_path / "replaced.mp4"
    with open_sink(replaced, 24, (64, 48), overwrite=True) as sink:
        sink.write(np.zeros((48, 64, 3), np.uint8))
        replaced.write_bytes(b"saved during the run")
    assert sink.kept_at == replaced and replaced.read_bytes() != b"saved during the run"
    assert sorted(tmp_path.iterdir()) == [replaced, out]


def test_an_output_that_is_the_input_or_exists_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "clip.mp4"
    src.write_bytes(b"input")
    with pytest.raises(MediaError, match="is the input file"):
        check_output_file(tmp_path / "." / "clip.mp4", [str(src)], overwrite=True)
    with pytest.raises(MediaError, match="exists; give --overwrite"):
        check_output_file(src, [], overwrite=False)
    check_output_file(tmp_path / "new.mp4", [str(src)], overwrite=False)


def test_a_tee_output_reaches_ffmpeg_under_the_name_given(tmp_path: Path) -> None:
    """The tee muxer reads its output names as FFmpeg tokens: a quote, a bar (its separator) or a backslash in an
    RTMP URL (a stream key) must reach the protocol as written, not cut or unquoted."""
    from loom_live.plugin.media.network_output import _tee_output

    path = tmp_path / "key'with|odd\\chars.flv"
    with av.open(_tee_output(str(path), "flv", 1.0), "w", format="tee") as out:
        video = out.add_stream("libx264", rate=24, options={"flags": "+global_header"})
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")
        out.mux(video.encode(frame))
        out.mux(video.encode(None))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_an_rtmp_output_reaches_ffmpegs_rtmp_server() -> None:
    url, server = rtmp_server("""
        c.streams.video[0].codec_context.thread_count = 1  # each frame out as its packet comes: none held at the end
        n = 0
        try:
            for frame in c.decode(video=0):
                n, size = n + 1, (frame.width, frame.height)
        except av.error.FFmpegError:
            pass  # the sender's goodbye
        print(n, *size)
    """)
    try:
        with open_when_listening(url, (160, 96)) as sink:
            for frame in generate_clip(24, (160, 96), 24, seed=3):
                sink.write(frame)
        out, _ = server.communicate(timeout=30)
    finally:
        server.kill()
        server.wait()
    assert out.split() == ["24", "160", "96"]


def _accept_one(server: socket.socket, accepted: list[socket.socket]) -> None:
    """Take one connection and never answer it."""
    with contextlib.suppress(TimeoutError):
        accepted.append(server.accept()[0])


@pytest.mark.parametrize("scheme", ["rtmp", "rtmps"])
def test_an_rtmp_server_that_takes_the_connection_and_never_answers_is_given_up_on(scheme: str) -> None:
    """A server that accepted the TCP connection and never answered the RTMP handshake (another service on that
    port, a port forward to a dead machine) held the output's open forever, and the GIL with it: the run froze at
    start. Now the open gives up after open_timeout, naming the URL and what to check. The output opens in a
    process of its own, so that a hang fails this test instead of freezing the suite."""
    accepted: list[socket.socket] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(60)
        thread = threading.Thread(target=_accept_one, args=(server, accepted), daemon=True)
        thread.start()
        url = f"{scheme}://127.0.0.1:{server.getsockname()[1]}/live/loom"
        script = textwrap.dedent("""
            import sys
            from loom_live.plugin.media.base import MediaError
            from loom_live.plugin.media.sinks import open_sink
            try:
                open_sink(sys.argv[1], 24, (64, 48), open_timeout=1.0)
            except MediaError as e:
                print(e)
        """)
        done = subprocess.run([sys.executable, "-c", script, url], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        thread.join(60)
    assert done.stdout.startswith(f"{url}: no answer within 1 s; check that the streaming server is running and "
                                  "that this is its address and port"), done.stdout + done.stderr
    assert accepted, "the server never saw the connection: the test did not reach the handshake"
    accepted[0].close()


def test_an_rtmp_receiver_that_stops_reading_fails_that_output_instead_of_stalling_the_show(monkeypatch) -> None:
    """A streaming server that takes nothing more (a network gone) blocked FFmpeg's send until TCP gave up:
    the run froze, deaf to Ctrl-C. Now the output fails within NETWORK_STALL_S and stops at once."""
    import loom_live.plugin.media.network_output as network_output

    monkeypatch.setattr(network_output, "NETWORK_STALL_S", 0.5)
    url, server = rtmp_server("time.sleep(60)")
    try:
        sink = open_when_listening(url, (256, 256))
        noise = np.random.default_rng(0).integers(0, 256, (8, 256, 256, 3), dtype=np.uint8)  # fills the buffers
        started = time.monotonic()
        with pytest.raises(MediaError, match="the receiver took nothing for 0.5 s"):
            for i in range(100_000):
                sink.write(noise[i % 8])
        assert time.monotonic() - started < 20
        started = time.monotonic()
        with pytest.raises(MediaError, match="stopped; the receiver took nothing") as ended:
            sink.close()
        assert type(ended.value) is MediaError  # no stop came: the output failed, it was not cut off by a stop
        sink.discard()
        assert time.monotonic() - started < 0.5
    finally:
        server.kill()
        server.wait()


def test_a_stop_gives_up_on_a_stalled_stream_output_at_once_not_after_its_stall_timeout(tmp_path: Path) -> None:
    """A streaming server that takes nothing more: a Ctrl-C waited the output's stall timeout (5 s; a minute here)
    while a write waited on the receiver, and as long again to close the output. Now the write gives up on a stop
    held back (signals_deferred, as the player writes) and close(stopping=True) waits STOP_GRACE_S. In a process
    of its own, where Ctrl-C is real."""
    read_all = tmp_path / "read-all"
    url, server = rtmp_server(f"open({str(read_all)!r}, 'w').close()\ntime.sleep(120)")
    script = textwrap.dedent("""
        import sys, threading, time
        from pathlib import Path
        import numpy as np
        from loom_live.plugin.media import network_output
        from loom_live.plugin.media.base import MediaError
        from loom_live.plugin.media.stop_signals import signals_deferred
        from tests.fakes.media import ctrl_c_once_stuck, open_when_listening, small_send_buffers

        network_output.NETWORK_STALL_S = 60.0  # a stop that waited on the receiver would take a minute or two
        small_send_buffers()
        sink = open_when_listening(sys.argv[1], (256, 256))
        pressed = []
        threading.Thread(target=ctrl_c_once_stuck, args=(sink._sender._queue, pressed, Path(sys.argv[2])),
                         daemon=True).start()
        noise = np.random.default_rng(0).integers(0, 256, (8, 256, 256, 3), dtype=np.uint8)  # more than they hold
        try:
            for i in range(10**6):
                with signals_deferred():
                    sink.write(noise[i % 8])
        except KeyboardInterrupt:
            pass
        try:
            sink.close(stopping=True)
        except MediaError as e:
            print(type(e).__name__, e)
        print(f"{time.monotonic() - pressed[0]:.1f}")
    """)
    try:
        done = subprocess.run([sys.executable, "-c", script, url, str(read_all)], cwd=REPO, capture_output=True,
                              text=True, timeout=180)
    finally:
        server.kill()
        server.wait()
    lines = done.stdout.splitlines()
    # cut off by the stop, which the player does not count as a failed output (a quit still ends with exit code 0)
    assert lines[:1] == [f"StreamCutOff {url}: stopped; the receiver took nothing for 0.5 s"], done.stdout + done.stderr
    assert float(lines[1]) < 30, f"the stop took {lines[1]} s: it waited on the stalled receiver"


class _StalledOutput:
    """What a network output's sending thread (NetworkSender) uses of its FrameSink, with a receiver that takes
    nothing: each encode waits until ``released``."""

    name = "rtmp://127.0.0.1/live/stalled"
    stopping = False
    stop = FrameSink.stop

    def __init__(self) -> None:
        self.released = threading.Event()

    def _encode(self, frame: np.ndarray, pts: int) -> None:
        self.released.wait()


def test_a_stop_from_another_thread_cuts_short_a_write_that_waits_on_a_stalled_receiver(monkeypatch) -> None:
    """A quit comes on OSC's thread while the frame loop's write waits on a receiver that takes nothing: the write
    gave up only after the stall timeout (5 s; a minute here). Now it drops its frame and returns as the stop
    comes, and the sending thread, still stuck, is left to its own timeout."""
    import loom_live.plugin.media.network_output as network_output

    monkeypatch.setattr(network_output, "NETWORK_STALL_S", 60.0)
    output = _StalledOutput()
    sender = network_output.NetworkSender(output)
    frame = np.zeros((2, 2, 3), np.uint8)
    try:
        assert all(sender.put(frame) for _ in range(NETWORK_QUEUE_FRAMES + 1))  # one stuck sending, the rest queued
        quit_later = threading.Timer(0.2, output.stop)  # when the next write waits (or before: the same outcome)
        quit_later.start()
        assert sender.put(frame) is False
        quit_later.join()
        assert sender.finish(0.0) is False
    finally:
        output.released.set()


def test_a_stop_made_while_a_write_waits_on_a_stalled_receiver_cuts_that_write_short(monkeypatch) -> None:
    """The player's window keys are read on the writing thread only: a quit key pressed while a write waited on a
    receiver that takes nothing was read once the write gave up, after the stall timeout (5 s; a minute here). Now
    the waiting write calls while_waiting (the player reads its keys there), and a stop made there cuts it short."""
    import loom_live.plugin.media.network_output as network_output

    monkeypatch.setattr(network_output, "NETWORK_STALL_S", 60.0)
    output, pressed = _StalledOutput(), []

    def poll_window() -> None:  # the player's key poll: a quit once the test has pressed it
        if pressed:
            output.stop()

    sender = network_output.NetworkSender(output, poll_window)
    frame = np.zeros((2, 2, 3), np.uint8)
    try:
        assert all(sender.put(frame) for _ in range(NETWORK_QUEUE_FRAMES + 1))  # one stuck sending, the rest queued
        pressed.append("q")
        assert sender.put(frame) is False  # the queue is full: this write waits, and the poll stops it
        assert sender.finish(0.0) is False
    finally:
        output.released.set()


def test_a_signal_held_back_stops_the_open_outputs_and_one_ignored_does_not(tmp_path: Path) -> None:
    """A signal held back by signals_deferred stops every open output (FrameSink.stop), so that none waits on a
    stalled receiver before it is delivered; one the program ignores (the player's finalising) stops nothing."""
    sink = open_sink(tmp_path / "out.mp4", 24, (64, 48))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals_deferred():
            signal.raise_signal(signal.SIGINT)
        assert not sink.stopping
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
        with pytest.raises(KeyboardInterrupt), signals_deferred():
            signal.raise_signal(signal.SIGINT)
            assert sink.stopping
    finally:
        signal.signal(signal.SIGINT, previous)
        sink.discard()


def test_a_ctrl_c_held_back_while_a_write_fails_is_still_delivered() -> None:
    """A write failed while signals_deferred held a Ctrl-C back: the failure went on and the Ctrl-C was lost (the
    run ended as failed, not as stopped by the user). Now the Ctrl-C is delivered, the failure as its context."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with pytest.raises(KeyboardInterrupt) as stopped, signals_deferred():
            signal.raise_signal(signal.SIGINT)
            raise MediaError("out.mp4: writing failed: No space left on device")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert isinstance(stopped.value.__context__, MediaError)


def test_the_readme_states_the_rtmp_open_timeout_the_code_uses() -> None:
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"one that does not answer within {DEFAULT_OPEN_TIMEOUT_S:g} s stops the run at the start" in readme
