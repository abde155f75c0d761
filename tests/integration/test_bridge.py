"""Two real processes over shared memory: the Bridge in this process, `loom serve --passthrough` in another.

Checks what a host relies on: exact content and order, a non-blocking frame loop through an
engine crash or hang, restart, and nothing left behind (processes, segments, sockets).
"""

from __future__ import annotations

import gc
import itertools
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from loom_live.host_bridge import Bridge, BridgeConfig, EngineRefused
from loom_live.host_bridge.wire import cpu_awake
from tests.fakes.engines import exiting_engine, indexed_frame, wait_until

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
posix_only = pytest.mark.skipif(not SHM.is_dir(), reason="needs POSIX shared memory under /dev/shm")


def _config(**kw) -> BridgeConfig:
    base = dict(passthrough=True, engine_cwd=str(ROOT), heartbeat_s=0.1, hang_timeout_s=1.0,
                restart_backoff_s=0.2, stop_timeout_s=1.0)
    return BridgeConfig(**{**base, **kw})


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("loom_*")} if SHM.is_dir() else set()


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _engine_took(bridge: Bridge, frames: int, timeout_s: float) -> bool:
    return wait_until(lambda: bridge.stats()["engine"].get("frames_in", 0) >= frames, timeout_s)


@posix_only
def test_thousand_frames_round_trip_in_order_with_exact_content():
    with Bridge(_config()) as bridge:
        bridge.wait_running(30)
        frames = [indexed_frame(i, 48, 64) for i in range(1000)]
        outputs = bridge.process(frames, timeout_s=60)
        assert len(outputs) == 1000
        for i, (a, b) in enumerate(zip(frames, outputs)):
            assert np.array_equal(a, b), f"frame {i} differs"
        segment_names = set(bridge.stats()["segments"])
        assert len(segment_names) == 3 and segment_names <= _segments()  # a ring per direction, the doorbell
        assert bridge.stats()["lane_endpoint"].startswith("doorbell:loom_")
        for name in segment_names:
            assert (SHM / name).stat().st_mode & 0o777 == 0o600
        pid = bridge.stats()["engine_pid"]
        # live mode: every output that arrives is the exact frame submitted with that sequence number
        sent = {}
        last_seq = -1
        for i in range(200):
            f = indexed_frame(5000 + i, 48, 64)
            bridge.submit(f)
            sent[bridge.last_seq] = f
            time.sleep(0.002)
            out, status = bridge.latest()
            if not status.fallback:
                assert status.seq >= last_seq
                last_seq = status.seq
                assert status.seq < 1000 or np.array_equal(out, sent[status.seq])
        assert last_seq >= 1000 and len(sent) == 200
    assert _gone(pid)
    assert not (_segments() & segment_names)


@pytest.mark.skipif(not SHM.is_dir() or not hasattr(os, "posix_fallocate"), reason="POSIX shared memory")
def test_a_frame_too_large_for_dev_shm_is_refused_and_counted_and_smaller_frames_go_on(monkeypatch):
    """A container's /dev/shm is small (64 MB by default): a 4K frame's ring does not fit. The host must refuse
    that frame with the reason and keep streaming, not die of SIGBUS on a later write."""
    real = os.posix_fallocate

    def small_dev_shm(fd, offset, size):
        if size > 1 << 20:
            raise OSError(28, "No space left on device")
        return real(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", small_dev_shm)
    with Bridge(_config()) as bridge:
        bridge.wait_running(30)
        bridge.submit(indexed_frame(1, 480, 640))  # two rings of 3 slots of 900 KB: over the 1 MB left
        assert wait_until(lambda: bridge.stats()["refused_frames"] == 1, 10)
        assert "frame refused" in bridge.status().message and "give /dev/shm more room" in bridge.status().message
        small = [indexed_frame(i, 48, 64) for i in range(5)]
        assert all(np.array_equal(a, b) for a, b in zip(small, bridge.process(small, timeout_s=30)))


@posix_only
def test_a_long_stream_through_the_tiny_model_comes_back_in_order():
    """The real embedded model behind the bridge, over a stream long enough that the KV ring wraps
    and RoPE refreshes many times (25 latent frames; a 3-frame ring, and a refresh every 2 latent frames
    once position 8 is reached). With the crop policy and a wider input the side bands pass through unchanged, so each
    output carries the identity of its input."""
    overrides = ["resolution.width=32", "resolution.height=32", "stream.steps=[700]", "stream.rope_refresh_at=8"]
    n = 5 + 4 * 24  # the first chunk, then 24 latent frames
    frames = []
    for i in range(n):
        f = indexed_frame(i, 32, 48)
        f[:, :8] = i % 251
        frames.append(f)
    with Bridge(_config(passthrough=False, engine_config="tiny-random", engine_overrides=overrides,
                        load_timeout_s=120)) as bridge:
        bridge.wait_running(120)
        outputs = bridge.process(frames, timeout_s=600)
    assert len(outputs) == n
    assert all(o.shape == (32, 48, 3) for o in outputs)
    assert [int(o[0, 0, 0]) for o in outputs] == [i % 251 for i in range(n)]
    assert not all(np.array_equal(a[:, 8:40], b[:, 8:40]) for a, b in zip(frames[:20], outputs[:20]))


@posix_only
def test_frame_size_changes_through_the_tiny_model():
    """A host that changes its resolution: lossless batches with mixed sizes come back whole and in
    order; a live stream changed mid-chunk goes on at the new size (the engine once kept refusing
    every frame after such a change)."""
    overrides = ["resolution.width=32", "resolution.height=32", "stream.steps=[700]"]
    sizes = [(32, 48)] * 7 + [(40, 64)] * 6 + [(32, 48)] * 3
    frames = []
    for i, (h, w) in enumerate(sizes):
        f = indexed_frame(i, h, w)
        f[:, :4] = i * 10  # the crop policy passes the side bands through: each output's identity
        frames.append(f)
    with Bridge(_config(passthrough=False, engine_overrides=overrides, load_timeout_s=120)) as bridge:
        bridge.wait_running(120)
        outputs = bridge.process(frames, timeout_s=120)
        assert [o.shape for o in outputs] == [f.shape for f in frames]
        assert [int(o[0, 0, 0]) for o in outputs] == [i * 10 for i in range(len(frames))]

        for i in range(7):  # live: a first chunk of 5 frames and 2 of the next, each taken by the engine
            bridge.submit(indexed_frame(i, 32, 48))  # (one replaced by the next, latest wins, would shift the chunks)
            assert _engine_took(bridge, len(frames) + i + 1, 20), bridge.stats()["engine"]
        deadline = time.monotonic() + 20
        fresh = None
        while fresh is None and time.monotonic() < deadline:
            bridge.submit(indexed_frame(0, 40, 64))
            time.sleep(0.03)
            out, status = bridge.latest()
            if not status.fallback and out.shape == (40, 64, 3):
                fresh = out
        assert fresh is not None, bridge.stats()["last_error"]
        assert bridge.stats()["restarts"] == 0


@posix_only
def test_a_prompt_missing_from_the_embeddings_file_is_refused_and_the_stream_goes_on(tmp_path):
    """An engine without umT5 reads prompts from a file written by `loom encode-prompts`."""
    from loom_live.engine.stream.prompts import HashTextEncoder
    from loom_live.plugin.cli.encode_prompts import write_embeddings

    path = tmp_path / "prompts.safetensors"
    write_embeddings(HashTextEncoder(4096), ["neon city", "ink wash"], path)  # umT5-XXL width, as Wan
    overrides = ["resolution.width=32", "resolution.height=32", "stream.steps=[700]", "prompt.encoder=file",
                 f"prompt.path={path}", "prompt.text=neon city"]
    with Bridge(_config(passthrough=False, engine_config="tiny-random", engine_overrides=overrides,
                        load_timeout_s=120)) as bridge:
        bridge.wait_running(120)
        with pytest.raises(ValueError, match="no embedding for prompt 'watercolour'.*ink wash"):
            bridge.set_prompt("watercolour", wait=True)
        bridge.set_prompt("ink wash", wait=True)
        outputs = bridge.process([indexed_frame(i, 32, 32) for i in range(9)], timeout_s=60)
        assert len(outputs) == 9 and bridge.status().state == "running"


@posix_only
def test_sigkill_mid_stream_falls_back_without_blocking_then_restarts_clean():
    period = 1 / 30
    bridge = Bridge(_config())
    bridge.set_prompt("ink wash, loose brush")  # before start: remembered, given to every engine
    bridge.set_params(noise_scale=0.5)
    bridge.start()
    try:
        bridge.wait_running(30)
        first_pid = bridge.stats()["engine_pid"]
        i = 0
        while bridge.status().frames_out < 10:
            bridge.submit(indexed_frame(i, 48, 64))
            i += 1
            time.sleep(period)
        first_segments = set(bridge.stats()["segments"])
        assert first_segments and first_segments <= _segments()
        os.kill(first_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        worst = 0.0
        saw_fallback = saw_down = False
        recovered_at = None
        while time.monotonic() - killed_at < 15:
            f = indexed_frame(i, 48, 64)
            t0 = time.monotonic()
            bridge.submit(f)
            out, status = bridge.latest()
            worst = max(worst, time.monotonic() - t0)
            if status.state != "running":
                saw_down = True
                assert status.fallback and np.array_equal(out, f)  # pass-through fallback: the frame just given
                saw_fallback = True
            elif saw_down and not status.fallback and status.seq > i - 30:
                recovered_at = time.monotonic()
                break
            i += 1
            time.sleep(period)
        assert saw_fallback and recovered_at is not None, bridge.status()
        assert recovered_at - killed_at < 10
        # a call held by the restart would wait for the engine's stop and start (a second or more)
        assert worst < 0.5, f"a host call blocked {worst * 1000:.1f} ms"
        assert bridge.status().restarts == 1
        assert _gone(first_pid)
        assert not (_segments() & first_segments), "the dead engine's segments were not removed"
        second_pid = bridge.stats()["engine_pid"]
        second_segments = set(bridge.stats()["segments"])
        assert second_pid != first_pid and second_segments
        # the remembered prompt reaches the new worker thread, then a stats poll reports it (the stats
        # taken at ready come first and hold the config's prompt: wait for the one set, not for a prompt)
        deadline = time.monotonic() + 15
        while (bridge.stats()["engine"].get("pid") != second_pid or
               bridge.stats()["engine"].get("session", {}).get("prompt") != "ink wash, loose brush") \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        session = bridge.stats()["engine"]["session"]
        assert session["prompt"] == "ink wash, loose brush" and session["params"] == {"noise_scale": 0.5}
    finally:
        bridge.close()
    assert _gone(second_pid)
    assert not (_segments() & second_segments)


def _engine_session(bridge: Bridge, pid: int, ready, timeout_s: float = 10.0) -> dict:
    """The session report of engine `pid` once `ready(report)` holds (reports come about once a second)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        engine = bridge.stats()["engine"]
        if engine.get("pid") == pid and ready(engine.get("session") or {}):
            return engine["session"]
        time.sleep(0.05)
    raise AssertionError(f"engine {pid} never reported the expected session: {bridge.stats()['engine']}")


@posix_only
def test_a_fresh_engine_is_told_the_hosts_prompt_and_params_exactly_once():
    """A host (the player's controls) sets a prompt before the engine runs; the first engine and a
    restarted one each receive it once: the bridge alone remembers and re-sends what the host wants."""
    from loom_live.plugin.player.controls import Controls, ControlState, prompt_command, steps_command

    def told(session: dict) -> bool:
        return session.get("prompt") == "velvet" and session.get("params") == {"steps": [700, 500, 400]}

    bridge = Bridge(_config())
    controls = Controls(ControlState(prompts=["ink"]))
    controls.put(prompt_command("velvet", 2))
    controls.put(steps_command(3))
    controls.apply_pending(bridge)  # before start: remembered by the bridge
    bridge.start()
    try:
        for engine in ("first", "restarted"):
            bridge.wait_running(30)
            pid = bridge.stats()["engine_pid"]
            for _ in range(3):  # the host's frame loop goes on applying (nothing new) while the engine runs
                controls.apply_pending(bridge)
                time.sleep(0.05)
            _engine_session(bridge, pid, told)
            time.sleep(1.5)  # one more report: a late second copy would have arrived by then
            session = _engine_session(bridge, pid, told)
            assert session["prompts_received"] == 1, (engine, session)
            if engine == "first":
                os.kill(pid, signal.SIGKILL)
                assert wait_until(lambda gone=pid: bridge.stats()["engine_pid"] not in (None, gone), 15)
        assert bridge.status().restarts == 1
        assert bridge.wanted.prompt.text == "velvet" and bridge.wanted.params == {"steps": [700, 500, 400]}
    finally:
        bridge.close()


def test_the_status_counts_frames_the_engine_dropped_on_either_side():
    """A frame the engine dropped coming in and one whose output it had no room to hand over are both
    frames the user never sees: the status's one `dropped` count has both (the engine's last report)."""
    bridge = Bridge(_config())
    try:
        bridge._sup.engine_report = {"dropped": 2, "dropped_out": 3}  # noqa: SLF001 (as a stats reply sets it)
        assert bridge.status().dropped == 5
    finally:
        bridge.close()


def test_lora_scales_that_add_up_past_the_limit_are_refused_and_the_remembered_ones_stay():
    """Each call's scales add to those set before, and a fresh engine is told the sum in one message: a
    sum over the limit would make every later engine refuse its catch-up, so the call that makes it is
    refused instead."""
    bridge = Bridge(_config())  # not started: what a later engine is told is remembered all the same
    try:
        eight = {f"style{i}": 0.5 for i in range(8)}
        bridge.set_params(noise_scale=0.6, lora_scales=eight)
        with pytest.raises(ValueError, match=r"lora_scales: .*at most 8.*counting those set before"):
            bridge.set_params(noise_scale=0.7, lora_scales={"ninth": 1.0})
        assert bridge.wanted.params == {"noise_scale": 0.6, "lora_scales": eight}  # nothing of the refused call
        bridge.set_params(lora_scales={"style0": 1.5})  # a known name changes its scale
        assert bridge.wanted.params["lora_scales"] == {**eight, "style0": 1.5}
    finally:
        bridge.close()


@posix_only
def test_a_bridge_dropped_without_close_stops_its_engine():
    """A notebook cell run again binds a new bridge and drops the old one unclosed: the old engine (and its
    GPU memory) must go with it, not stay until the host process exits; also once frames were shrunk on the
    bridge's own thread."""
    bridge = Bridge(_config(max_frame_side=64)).start()
    bridge.wait_running(30)
    bridge.submit(indexed_frame(1, 128, 96))  # over max_frame_side: shrunk on the shrinking thread
    assert wait_until(lambda b=bridge: b.stats()["sent"] >= 1, 10)
    pid, segments = bridge.stats()["engine_pid"], set(bridge.stats()["segments"])
    gone = weakref.ref(bridge)
    del bridge
    gc.collect()
    assert gone() is None and _gone(pid) and not (_segments() & segments)


@posix_only
def test_a_bridge_closed_from_another_thread_ends_a_blocking_stream_saying_closed():
    """A host closing its bridge (a stop button) while another thread streams a file: that thread's error says
    the bridge was closed, not that a running engine stopped ("running: engine running")."""
    bridge = Bridge(_config()).start()
    bridge.wait_running(30)
    raised: list[BaseException] = []

    def stream() -> None:
        try:
            for _ in bridge.process_stream(indexed_frame(i % 8, 48, 64) for i in itertools.count()):
                pass
        except RuntimeError as exc:
            raised.append(exc)

    worker = threading.Thread(target=stream)
    worker.start()
    assert wait_until(lambda: bridge.stats()["received"] >= 20, 10)
    bridge.close()
    worker.join(10)
    assert not worker.is_alive() and len(raised) == 1
    assert str(raised[0]).endswith("stopped: closed"), raised


@posix_only
def test_hung_engine_is_detected_soon_after_its_timeout_and_replaced():
    bridge = Bridge(_config(stop_timeout_s=0.3)).start()
    try:
        bridge.wait_running(30)
        pid = bridge.stats()["engine_pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        while bridge.status().state == "running" and time.monotonic() - stopped_at < 20:
            bridge.submit(indexed_frame(0, 48, 64))
            time.sleep(0.02)
        # hang_timeout_s is 1 s: "within 5 s" has room for a loaded machine, and still fails a detector
        # that never fires or waits for something else (a stop timeout, a heartbeat backlog)
        assert time.monotonic() - stopped_at < 5.0, "hang not detected within 5 s of a 1 s hang timeout"
        assert "silent" in bridge.status().message
        bridge.wait_running(15)
        assert bridge.stats()["engine_pid"] != pid
        assert _gone(pid)  # the stopped process was killed, not left behind
    finally:
        bridge.close()


@posix_only
def test_stalled_engine_never_grows_host_memory():
    bridge = Bridge(_config(engine_args=["--stall-after", "5"])).start()
    try:
        bridge.wait_running(30)
        frame = indexed_frame(1, 128, 128)  # 48 KiB per frame: 3,000 leaked frames would be 147 MiB
        for _ in range(50):
            bridge.submit(frame)
        time.sleep(0.3)
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(3000):
            assert bridge.submit(frame) in (True, False)
        grown = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        stats = bridge.stats()
        assert grown < 2 * 2**20, f"host memory grew by {grown / 2**20:.1f} MiB"
        assert stats["in_flight"] <= bridge.config.ring_slots
        assert stats["submitted"] == 3050
        assert stats["submitted"] - stats["sent"] <= stats["dropped"] + 1  # every frame not sent is counted
        assert bridge.status().state == "running"  # stalled is not dead: it keeps its heartbeat
    finally:
        bridge.close()


HOST_SCRIPT = textwrap.dedent("""
    import sys, time, numpy as np
    from loom_live.host_bridge import Bridge, BridgeConfig
    b = Bridge(BridgeConfig(passthrough=True, engine_cwd=sys.argv[1])).start()
    b.wait_running(30)
    b.submit(np.zeros((16, 16, 3), np.uint8))
    while b.status().frames_out < 1:
        time.sleep(0.01)
    print(b.stats()["engine_pid"], b.stats()["endpoint"], " ".join(b.stats()["segments"]), flush=True)
    time.sleep(60)
""")


@posix_only
def test_engine_exits_and_removes_segments_when_its_host_dies():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    host = subprocess.Popen([sys.executable, "-c", HOST_SCRIPT, str(ROOT)], stdout=subprocess.PIPE, env=env)
    try:
        pid_text, endpoint, *names = host.stdout.readline().decode().split()
        engine_pid, names = int(pid_text), set(names)
        private_dir = Path(endpoint.removeprefix("ipc://")).parent
        assert private_dir.is_dir() and private_dir.stat().st_mode & 0o777 == 0o700
        assert len(names) == 3 and names <= _segments()  # a ring per direction and the doorbell
        host.kill()
        host.wait()
        assert _gone(engine_pid, 5.0), "engine outlived its host"
        assert not (_segments() & names), "segments left after the host died"
        assert not private_dir.exists(), "the private endpoint directory was left behind"
    finally:
        host.kill()


STARTING_HOST_SCRIPT = textwrap.dedent("""
    # a host killed while its engine starts: it launched the engine (private endpoint, doorbell) as the
    # bridge does, and dies once the engine said hello, before answering it
    import os, subprocess, sys, zmq
    from loom_live.host_bridge.launcher import TOKEN_ENV, popen_options
    from loom_live.host_bridge.wire.channel import Channel, PrivateEndpoint
    from loom_live.host_bridge.wire.doorbell import Doorbell
    endpoint, bell = PrivateEndpoint(), Doorbell.create()
    channel = Channel(zmq.Context(), endpoint.address, bind=True)
    engine = subprocess.Popen([sys.executable, "-m", "loom_live.engine", "serve", "--connect", endpoint.address,
                               "--passthrough", "--parent-pid", str(os.getpid())], cwd=sys.argv[1],
                              env={**os.environ, TOKEN_ENV: "t"}, stdin=subprocess.DEVNULL, **popen_options())
    while not any(msg["type"] == "hello" for msg, _ in channel.poll(0.1)):
        pass
    print(engine.pid, endpoint.dir, bell.name, flush=True)
    os.kill(os.getpid(), 9)
""")


@posix_only
def test_engine_exits_and_cleans_up_when_its_host_dies_before_the_handshake():
    """Before the host's hello the engine has no session, but its parent is known: it must not wait out the
    handshake timeout (20 s) after the host is gone, nor leave the host's endpoint folder and doorbell."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    host = subprocess.Popen([sys.executable, "-c", STARTING_HOST_SCRIPT, str(ROOT)], stdout=subprocess.PIPE, env=env)
    engine_pid = None
    try:
        pid_text, private_dir, doorbell = host.stdout.readline().decode().split()
        engine_pid = int(pid_text)
        assert host.wait(10) == -signal.SIGKILL
        assert _gone(engine_pid, 5.0), "engine outlived its host (waiting out its handshake timeout)"
        assert not Path(private_dir).exists(), "the private endpoint directory was left behind"
        assert doorbell not in _segments(), "the dead host's doorbell segment was left behind"
    finally:
        host.kill()
        if engine_pid is not None:
            try:
                os.kill(engine_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


GROUP_SCRIPT = textwrap.dedent("""
    # an engine whose leader is gone and whose group still holds a process that cleans up on SIGTERM (as
    # multiprocessing's resource tracker unlinks the ranks' semaphores once the others are gone)
    import os, subprocess, sys, time
    folder = sys.argv[1]
    child = (
        "import os, signal, sys, time\\n"
        "def done(*_):\\n"
        "    time.sleep(0.3)\\n"
        "    open(os.path.join(sys.argv[1], 'cleaned'), 'w').close()\\n"
        "    os._exit(0)\\n"
        "signal.signal(signal.SIGTERM, done)\\n"
        "open(os.path.join(sys.argv[1], 'ready'), 'w').close()\\n"
        "time.sleep(60)\\n")
    subprocess.Popen([sys.executable, "-c", child, folder])
    while not os.path.exists(os.path.join(folder, "ready")):
        time.sleep(0.01)
""")


@posix_only
def test_stopping_an_engine_whose_leader_died_lets_the_rest_of_its_group_clean_up(tmp_path):
    """A killed engine's resource tracker ignores SIGTERM until its ranks are gone, then unlinks their semaphores
    (/dev/shm/sem.mp-*): stop() must ask what is left of the group and give it until its deadline, not kill it
    at once because the leader is already dead (three semaphores leaked per killed pipeline engine)."""
    from loom_live.host_bridge.launcher import EngineProcess

    engine = EngineProcess([sys.executable, "-c", GROUP_SCRIPT, str(tmp_path)])
    engine.proc.wait(30)
    assert (tmp_path / "ready").exists() and not engine.alive
    engine.stop(timeout_s=10)
    assert (tmp_path / "cleaned").exists(), "the group was killed before it could clean up"


UNREAPED_SCRIPT = textwrap.dedent("""
    # a host that reaps no orphan (a container's first process): the engine's leader exits, its child exits
    # after it and stays a zombie of the group; stop() must not wait its whole timeout for that
    import ctypes, os, sys, time
    from loom_live.host_bridge.launcher import EngineProcess
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to this process, unreaped
    leader = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(0.3)'])"
    engine = EngineProcess([sys.executable, "-c", leader])
    engine.proc.wait(30)
    time.sleep(1.0)  # the child has exited too: a zombie nobody reaps
    start = time.monotonic()
    engine.stop(timeout_s=5)
    print(f"{time.monotonic() - start:.2f}")
""")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux: a process's state is read in /proc")
def test_a_process_that_exited_unreaped_is_not_alive_so_what_it_held_is_swept_at_once():
    """An engine sees its killed host go before the host's parent reaps it: the host is then a zombie, and its
    doorbell and rings must be swept as a dead owner's, not left for a later host to find."""
    from loom_live.host_bridge.wire.processes import pid_alive, zombie

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    assert wait_until(lambda: zombie(child.pid), 30)
    assert not pid_alive(child.pid)
    child.wait()
    assert pid_alive(os.getpid()) and not zombie(os.getpid())


@pytest.mark.parametrize("pid", [0, -1, 2**31, 10**20])
def test_a_number_no_process_can_have_is_not_alive(pid):
    """Pids are read from names in shared folders (rings, doorbells, a run's hidden folder): one made by hand
    (0 or a negative, which `os.kill` takes as a process group; a huge one, which overflows it) is no process."""
    from loom_live.host_bridge.wire.processes import pid_alive

    assert pid_alive(pid) is False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux: the group's members are read in /proc")
def test_stopping_an_engine_whose_group_holds_only_zombies_does_not_wait_for_them():
    took = subprocess.run([sys.executable, "-c", UNREAPED_SCRIPT], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert took.returncode == 0, took.stderr
    assert float(took.stdout.strip().splitlines()[-1]) < 2.0, "stop() waited for zombies to exit"


@posix_only
def test_segments_of_dead_owners_are_swept():
    from loom_live.host_bridge.wire.rings import create_ring
    from loom_live.host_bridge.wire.rings.shm import open_segment

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    name = f"loom_{dead.pid}_0123456789ab"
    open_segment(name, create=True, size=64).close()  # a crashed owner's segment
    ring = create_ring("shm", "in", slots=2, width=4, height=4)
    try:
        assert name not in _segments()
        assert ring.spec.handles[0].startswith(f"loom_{os.getpid()}_")
    finally:
        ring.close()


def test_settings_fail_with_key_value_and_allowed():
    from loom_live.host_bridge.wire.typed_config import ConfigError

    with pytest.raises(ConfigError, match=r"transport: 'udp' is not allowed; expected one of 'shm'"):
        BridgeConfig(transport="udp")
    with pytest.raises(ConfigError, match="ring_slots"):
        BridgeConfig(ring_slots=1)
    with pytest.raises(ConfigError, match="hang_timeout_s"):
        BridgeConfig(hang_timeout_s=5.0)
    with pytest.raises(ConfigError, match="endpoint: required"):
        BridgeConfig(launch=False)
    with pytest.raises(ConfigError, match="unknown key"):
        BridgeConfig.from_dict({"transprot": "shm"})


def test_engine_config_error_ends_the_engine_once_with_its_own_message():
    """A config the engine refuses (exit code 2) would be refused by every restart: the bridge stops there,
    dead, with the engine's message, instead of restarting it and repeating the error."""
    bridge = Bridge(_config(engine_overrides=["model.preset=bogus"])).start()
    try:
        with pytest.raises(EngineRefused, match="model.preset: 'bogus' is not allowed") as refused:
            bridge.wait_running(30)
        assert "Traceback" not in str(refused.value)
        status = bridge.status()
        assert status.state == "dead" and status.restarts == 0
        assert status.message.startswith("the engine refused to start: ") and status.message.count("bogus") == 1
        assert status.refusal == str(refused.value) == bridge.stats()["refusal"]
    finally:
        bridge.close()


@pytest.mark.skipif(os.name == "nt", reason="the stand-in engine is a POSIX shell script")
@pytest.mark.parametrize("code", [1, -9])
def test_an_engine_that_dies_before_it_is_ready_is_reported_at_once_and_a_refusal_once(tmp_path, code):
    """Restarts are for engines that ran: one that dies while starting (a wrong engine Python, a missing
    module, a crash while loading) would die again, so the bridge says so at once, with its last lines.
    Exit code 2 is the engine refusing its run: said in its own words."""
    crash = "kill -9 $$" if code < 0 else f"exit {code}"
    script = exiting_engine(tmp_path, 0, "ModuleNotFoundError: No module named 'loom_live'")
    script.write_text(script.read_text().replace("exit 0", crash))
    bridge = Bridge(_config(engine_python=str(script), passthrough=False)).start()
    try:
        with pytest.raises(RuntimeError, match="engine is dead") as failed:
            bridge.wait_running(30)
        status = bridge.status()
        assert status.state == "dead" and status.restarts == 0 and not status.refusal
        ended = "engine killed by SIGKILL (its last output: " if code < 0 else f"engine exited with code {code}: "
        assert status.message.startswith(f"the engine could not start: {ended}"), status.message
        assert "engine starting" in status.log_tail and "engine starting" in str(failed.value)
        time.sleep(0.5)  # longer than the restart backoff: a restart would have begun by now
        assert bridge.status().restarts == 0 and bridge.status().state == "dead"
    finally:
        bridge.close()
    refusing = exiting_engine(tmp_path, 2, "preset 'x' needs weights that are not here", name="refusing")
    bridge = Bridge(_config(engine_python=str(refusing), passthrough=False)).start()
    try:
        assert wait_until(lambda: bridge.status().state == "dead", 30), bridge.status()
        time.sleep(0.5)  # longer than the restart backoff: a restart would have begun by now
        status = bridge.status()
        assert status.restarts == 0 and status.state == "dead"
        assert status.message == "the engine refused to start: preset 'x' needs weights that are not here"
        with pytest.raises(EngineRefused, match="^preset 'x' needs weights that are not here$"):
            bridge.wait_running(5)
    finally:
        bridge.close()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the engine under its wrapper through /proc")
def test_an_engine_that_ran_and_then_exits_2_is_restarted_like_any_crash(tmp_path):
    """Exit code 2 means a refused run only before the engine was ready: one that ran is restarted, so a show
    goes on. The stand-in runs the real engine, then exits 2 when it ends (here: killed)."""
    wrapper = tmp_path / "engine-python"
    wrapper.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import subprocess, sys
        args = sys.argv[1:]
        at = args.index("--parent-pid")  # the engine's parent is this wrapper, not the host
        subprocess.call([sys.executable, *args[:at], *args[at + 2:]])
        sys.exit(2)
    """))
    wrapper.chmod(0o755)
    bridge = Bridge(_config(engine_python=str(wrapper))).start()
    try:
        bridge.wait_running(60)
        shell = bridge.stats()["engine_pid"]
        engine = int(Path(f"/proc/{shell}/task/{shell}/children").read_text().split()[0])
        os.kill(engine, signal.SIGKILL)
        assert wait_until(lambda: bridge.status().restarts >= 1, 30), bridge.status()
        assert bridge.wait_running(60).refusal == ""
    finally:
        bridge.close()


def test_missing_engine_python_is_reported_not_raised():
    bridge = Bridge(_config(engine_python="/nonexistent/python", restart=False)).start()
    try:
        with pytest.raises(RuntimeError, match="cannot start the engine with /nonexistent/python: No such file or "
                                               "directory: /nonexistent/python") as raised:
            bridge.wait_running(10)
        assert str(raised.value).startswith("engine is dead: ")  # at once: no timeout was waited out
        frame = indexed_frame(3, 48, 64)
        bridge.submit(frame)
        out, status = bridge.latest()
        assert status.state == "dead" and np.array_equal(out, frame)
    finally:
        bridge.close()


def test_a_missing_engine_cwd_is_named_not_blamed_on_the_python(tmp_path):
    """A working folder that does not exist made the same OSError as a missing Python, and the message named
    engine_python ('None' when unset)."""
    bridge = Bridge(_config(engine_cwd=str(tmp_path / "gone"), restart=False)).start()
    try:
        with pytest.raises(RuntimeError, match=r"cannot start the engine: engine_cwd '.*gone': No such file or "
                                               r"directory"):
            bridge.wait_running(10)
    finally:
        bridge.close()


def test_a_loading_engine_may_be_silent_longer_than_a_running_one():
    """Reading a checkpoint or compiling can hold the engine's GIL (and its heartbeats) for seconds:
    that must not get a loading engine killed and restarted forever, while a running one that goes
    silent is still given up on after hang_timeout_s."""
    import threading

    from loom_live.host_bridge.link import Link

    cfg = _config(loading_hang_timeout_s=8.0)
    quiet = SimpleNamespace(handshake_refusal=None, endpoint=None)  # a channel that hears nothing
    link = Link(1, channel=quiet, lane=None, proc=None, endpoint=None, token=None, cfg=cfg, lock=threading.RLock())
    link.phase = "loading"
    link.load_deadline = link.last_heard + 100.0
    assert link.check(link.last_heard + 3.0) is None  # 3 s > hang_timeout_s (1 s), still loading
    assert "while loading" in link.check(link.last_heard + 9.0)
    link.on_ready({})
    assert "silent" in link.check(link.last_heard + 1.5)
    with pytest.raises(ValueError, match="loading_hang_timeout_s"):
        BridgeConfig(hang_timeout_s=1.0, loading_hang_timeout_s=0.5)


@posix_only
def test_a_bridge_holds_the_cpus_awake_while_started_and_streams_the_same_where_it_cannot(tmp_path, monkeypatch):
    """hold_cpu_awake: the limit is written when the bridge starts and given back when it closes; where it cannot
    be held the frames flow as ever and stats() says why. Without the setting nothing is asked."""
    target = tmp_path / "cpu_dma_latency"
    target.write_bytes(b"")
    frames = [indexed_frame(i, 32, 48) for i in range(12)]
    for latency_file, said in [(target, {"held": True, "why": ""}),
                               (tmp_path / "absent", {"held": False, "why": f"cannot open {tmp_path / 'absent'} (No "
                                                      "such file or directory): the CPUs keep their own idle states"})]:
        monkeypatch.setattr(cpu_awake, "LATENCY_FILE", latency_file)
        with Bridge(_config(hold_cpu_awake=True)) as bridge:
            bridge.wait_running(30)
            assert bridge.stats()["cpu_awake"] == said
            outputs = bridge.process(frames, timeout_s=30)
            assert all(np.array_equal(a, b) for a, b in zip(frames, outputs)) and len(outputs) == len(frames)
        assert bridge.stats()["cpu_awake"]["held"] is False
    assert target.read_bytes() == struct.pack("i", 0)
    assert str(target) not in {os.readlink(fd) for fd in Path("/proc/self/fd").iterdir() if fd.is_symlink()}
    assert Bridge(_config()).stats()["cpu_awake"] is None
