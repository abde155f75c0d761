"""The frame lane (tcp links): frames travel on their own socket, used directly by the threads that move them.

What a host relies on: frames do not go through the control channel (its counters stay flat), a
frame message on the wrong socket is refused and counted, a thread sending while another waits on
the lane is never blocked, and the lane's endpoint disappears with its link (close, engine crash).
shm and cuda-ipc links use the shared-memory doorbell instead (tests/integration/test_doorbell.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.host_bridge import Bridge, BridgeConfig
from loom_live.host_bridge.client import SIZE_SETTLE_FRAMES
from loom_live.host_bridge.wire.channel import EndpointError
from loom_live.host_bridge.wire.frame_lane import FrameLane, lane_bind_address, lane_endpoint_for
from loom_live.host_bridge.wire.protocol import decode, encode, make
from tests.fakes.engines import InProcessEngine, indexed_frame, wait_until

ROOT = Path(__file__).resolve().parents[2]
posix_ipc = pytest.mark.skipif(not zmq.has("ipc") or os.name == "nt", reason="needs ipc endpoints")


def test_lane_endpoints_follow_the_control_endpoint():
    assert lane_endpoint_for("tcp://10.1.2.3:5555", "tcp://0.0.0.0:6001") == "tcp://10.1.2.3:6001"
    assert lane_endpoint_for("tcp://[::1]:5555", "tcp://[::1]:6001") == "tcp://[::1]:6001"
    assert lane_endpoint_for("ipc:///tmp/d/control", "ipc:///tmp/d/lane") == "ipc:///tmp/d/lane"
    with pytest.raises(EndpointError, match="does not match"):
        lane_endpoint_for("tcp://127.0.0.1:5555", "ipc:///tmp/elsewhere")
    with pytest.raises(EndpointError, match="HOST:PORT"):
        lane_endpoint_for("tcp://127.0.0.1:5555", "tcp://127.0.0.1:*")
    assert lane_bind_address("tcp://0.0.0.0:5555") == "tcp://0.0.0.0:*"
    assert lane_bind_address("ipc:///run/x/ctl").startswith("ipc:///run/x/ctl-lane-")
    ctx = zmq.Context()
    try:
        with pytest.raises(EndpointError, match="CurveZMQ keys are required"):
            FrameLane(ctx, "tcp://192.168.7.7:6001", bind=False, side="host")  # same rule as the control channel
    finally:
        ctx.term()


def test_a_send_that_fails_lets_the_lane_go(monkeypatch):
    """A send that fails (an unexpected socket error, a Ctrl-C while it runs) is raised, and the lane's lock is let
    go: held, it stopped every later send, and close() waited on it for ever."""
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.setsockopt(zmq.RCVTIMEO, 10_000)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    lane = FrameLane(ctx, f"tcp://127.0.0.1:{port}", bind=False, side="host")
    try:
        def fail() -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(lane, "_flush", fail)
        with pytest.raises(KeyboardInterrupt):
            lane.send_release(0, 1)
        taken: list[bool] = []
        other = threading.Thread(target=lambda: taken.append(lane.acquire(blocking=False)) or lane.lock.release())
        other.start()
        other.join(10)
        assert taken == [True], "a failed send left the lane's lock held"
        monkeypatch.undo()
        assert lane.send_release(1, 1)
        assert [decode(peer.recv_multipart())["slot"] for _ in range(2)] == [0, 1], "the failed send was lost"
    finally:
        lane.close()
        peer.close()
        ctx.term()


def test_a_send_while_another_thread_waits_on_the_lane_goes_out_at_once():
    ctx = zmq.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    lane = FrameLane(ctx, f"tcp://127.0.0.1:{port}", bind=False, side="host")
    try:
        holding = threading.Event()

        def waiter():
            with lane.lock:
                holding.set()
                lane.receive(20.0)  # a wait_for_output() in another thread; woken by the send below

        thread = threading.Thread(target=waiter)
        thread.start()
        assert holding.wait(5)
        t0 = time.monotonic()
        assert lane.send(make("frame", dir="in", slot=1, seq=7, gen=1))
        # blocked, it would wait out the holder's 20 s receive; the margin is for a loaded CI box
        assert time.monotonic() - t0 < 5, "send waited for the lane's lock"
        assert peer.poll(1000), "a message queued behind the lock holder was not sent"
        assert decode(peer.recv_multipart())["seq"] == 7
        thread.join(5)
        assert time.monotonic() - t0 < 10  # the waiter was woken, not left to its 20 s timeout
        peer.send(encode(make("frame", dir="in", slot=0, seq=1, gen=1)))  # the host's own direction
        peer.send(encode(make("heartbeat", t=1.0)))  # a control message
        with lane.lock:
            assert wait_until(lambda: lane.receive(0.05) == [] and lane.refused == 2, 5)
        assert "frame lane" in lane.last_refusal
    finally:
        lane.close()
        peer.close()
        ctx.term()


@posix_ipc
def test_frames_use_the_lane_and_it_is_removed_after_sigkill_and_close():
    cfg = BridgeConfig(transport="tcp", passthrough=True, engine_cwd=str(ROOT), heartbeat_s=0.1, hang_timeout_s=1.0,
                       restart_backoff_s=0.2, stop_timeout_s=1.0)
    with Bridge(cfg) as bridge:
        bridge.wait_running(30)
        stats = bridge.stats()
        control, lane = Path(stats["endpoint"][len("ipc://"):]), Path(stats["lane_endpoint"][len("ipc://"):])
        assert lane.parent == control.parent and lane.exists()  # the same private 0700 directory
        assert control.parent.stat().st_mode & 0o777 == 0o700
        before = bridge.stats()["messages"]
        n = 300
        for i in range(n):
            bridge.submit(indexed_frame(i))
            assert bridge.wait_for_output(bridge.last_seq, 5), bridge.status()
        out, status = bridge.latest()
        assert np.array_equal(out, indexed_frame(n - 1)) and status.seq == bridge.last_seq
        after = bridge.stats()["messages"]
        assert after["lane_sent"] - before["lane_sent"] >= 2 * n - 1  # a notice and a release per frame
        assert after["lane_received"] - before["lane_received"] >= 2 * n - 1
        control_traffic = sum(after[k] - before[k] for k in ("control_sent", "control_received"))
        assert control_traffic < n / 4, after  # heartbeats and stats only, not per frame
        assert wait_until(lambda: bridge.stats()["engine"].get("lane_received", 0) >= n, 5)
        assert bridge.stats()["engine"]["control_received"] < n / 4

        # a host thread waiting for output never blocks another thread's submit
        got = []
        waiter = threading.Thread(target=lambda: got.append(bridge.wait_for_output(bridge.last_seq + 1, 30)))
        waiter.start()
        time.sleep(0.05)
        t0 = time.monotonic()
        bridge.submit(indexed_frame(9999))
        assert time.monotonic() - t0 < 5  # blocked, it would wait out the waiter's 30 s
        waiter.join(30)
        assert got == [True]

        os.kill(bridge.stats()["engine_pid"], signal.SIGKILL)
        killed_at = time.monotonic()

        def flowing() -> bool:
            bridge.submit(indexed_frame(1))
            _, st = bridge.latest()
            return st.state == "running" and not st.fallback and st.seq > n + 2

        assert wait_until(flowing, 10), bridge.status()
        assert time.monotonic() - killed_at < 10
        assert not lane.exists() and not control.parent.exists(), "the dead engine's lane was left behind"
        new_lane = Path(bridge.stats()["lane_endpoint"][len("ipc://"):])
        assert new_lane != lane and new_lane.exists()
    assert not new_lane.exists() and not new_lane.parent.exists()


@pytest.mark.parametrize("transport", ["tcp", "shm"])  # notices on the lane, or through the doorbell
def test_the_first_frame_after_a_resolution_change_waits_for_its_ring(transport):
    """Rings travel on the control channel, notices on the lane or doorbell: a notice may arrive first.
    The engine holds it until its ring is attached instead of dropping it as stale."""
    cfg = BridgeConfig(transport=transport, passthrough=True, engine_cwd=str(ROOT), heartbeat_s=0.1,
                       hang_timeout_s=1.0)
    with Bridge(cfg) as bridge:
        bridge.wait_running(30)
        run = SIZE_SETTLE_FRAMES + 2  # a new size is taken (new rings) at its SIZE_SETTLE_FRAMES-th frame
        for i in range(3 * run):
            size = (24, 32) if (i // run) % 2 == 0 else (40, 56)
            frame = np.random.default_rng(i).integers(0, 256, (*size, 3), dtype=np.uint8)
            bridge.submit(frame)
            assert bridge.wait_for_output(bridge.last_seq, 5), f"frame {i} ({size}) lost after a ring change"
            out, status = bridge.latest()
            assert status.seq == bridge.last_seq
            if i < run or i % run >= SIZE_SETTLE_FRAMES - 1:
                assert np.array_equal(out, frame)
            else:  # fitted to the size in use until the new one has held
                assert out.shape != frame.shape
        assert wait_until(lambda: bridge.stats()["engine"].get("frames_in") == 3 * run, 5)
        assert bridge.stats()["engine"]["stale"] == 0 and bridge.stats()["refused"] == 0


@posix_ipc
def test_served_engine_lane_refuses_frames_on_control_and_is_removed_when_the_host_leaves(tmp_path):
    engine = InProcessEngine(PassthroughSession, bind=f"ipc://{tmp_path}/ctl")
    server = engine.server
    try:
        cfg = BridgeConfig(**engine.host, transport="tcp", heartbeat_s=0.1,
                           hang_timeout_s=1.0)
        with Bridge(cfg) as bridge:
            bridge.wait_running(10)
            lanes = list(tmp_path.glob("ctl-lane-*"))
            assert len(lanes) == 1 and bridge.stats()["lane_endpoint"] == f"ipc://{lanes[0]}"
            outs = bridge.process([indexed_frame(i) for i in range(20)], timeout_s=20)
            assert all(np.array_equal(o, indexed_frame(i)) for i, o in enumerate(outs))
            # a valid frame notice on the control channel is refused by the engine and not processed
            served = server.worker.counts["frames_in"]
            bridge._link.send(make("frame", dir="in", slot=0, seq=10_000, gen=bridge._link.generation))
            assert wait_until(lambda: bridge.stats()["engine"].get("refused") == 1, 5), bridge.stats()["engine"]
            assert "control channel" in bridge.stats()["engine"]["last_refusal"]
            assert server.worker.counts["frames_in"] == served
        assert wait_until(lambda: not list(tmp_path.glob("ctl-lane-*")), 5), "the engine left its lane file behind"
    finally:
        engine.stop()
