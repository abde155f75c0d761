"""Careless and hostile peers, round two (issue 32), through real processes, sockets, engines and bridges:
one host's messages go only to that host, nothing a host sends can freeze it or park the engine, and a
bad file is refused up front."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from host_bridge import Bridge, BridgeConfig, EngineState
from host_bridge.wire import pixels
from host_bridge.wire.channel import Channel, SharedSecret, read_secret_file
from host_bridge.wire.protocol import make
from tests.fakes.engines import served_engine, wait_until

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with served_engine(tmp_path_factory.mktemp("served")) as endpoint_and_secret:
        yield endpoint_and_secret


def _waiting_host(endpoint: str, secret_file: str, ctx: zmq.Context) -> Channel:
    """A second host that holds the secret and says hello, as a connecting bridge does."""
    return Channel(ctx, endpoint, bind=False, curve=SharedSecret(read_secret_file(secret_file), server=False))


def test_a_waiting_host_hears_only_that_it_waits_and_the_attached_host_loses_nothing(served):
    """Point 1: the engine's replies went round-robin to every peer past the handshake, so a host waiting
    to get in took the attached host's heartbeats, acks and stats (and its set_params timed out)."""
    endpoint, secret = served
    ctx = zmq.Context()
    cfg = BridgeConfig(launch=False, endpoint=endpoint, secret_file=secret, transport="tcp", heartbeat_s=0.1,
                       request_timeout_s=3.0)
    waiting = None
    try:
        with Bridge(cfg) as attached:
            attached.wait_running(30)
            waiting = _waiting_host(endpoint, secret, ctx)
            heard: list[dict] = []
            hello = make("hello", role="host", token=read_secret_file(secret), pid=os.getpid() + 1,
                         transports=["tcp"])
            for i in range(3):
                waiting.send(hello)
                attached.set_params(wait=True, noise_scale=0.5 + 0.1 * i)  # each answered, none taken
                attached.set_prompt(f"style {i}", wait=True)
                deadline = time.monotonic() + 0.4
                while time.monotonic() < deadline:
                    heard += [m for m, _ in waiting.poll(0.05)]
            frames = [np.full((8, 8, 3), i * 30, np.uint8) for i in range(4)]
            assert all(np.array_equal(a, b) for a, b in zip(frames, attached.process(frames, timeout_s=20)))
            assert attached.status().state == EngineState.RUNNING and attached.status().restarts == 0
        kinds = [m["type"] for m in heard]
        assert kinds and set(kinds) == {"wait"}, kinds
        assert "another host" in heard[0]["reason"]
    finally:
        if waiting is not None:
            waiting.close()
        ctx.term()


def test_a_bridge_without_the_secret_of_a_served_engine_is_refused_when_it_is_made(served):
    """Point 2: it showed `restarting` and tried again every 20 s, never saying why."""
    endpoint, _ = served
    line = (f"endpoint {endpoint}: an engine served on this machine takes only hosts that hold its session "
            "secret; give secret_file FILE, the file its `loom serve --secret-file` uses")
    with pytest.raises(ValueError) as refused:
        Bridge(launch=False, endpoint=endpoint, transport="tcp")
    assert str(refused.value) == f"BridgeConfig: {line}"  # the hosts' own line, as every BridgeConfig error
    with pytest.raises(ValueError, match="give secret_file FILE"):
        BridgeConfig(launch=False, endpoint="ipc:///tmp/loom-engine", transport="tcp")


def _launched(**kw) -> BridgeConfig:
    base = dict(passthrough=True, engine_cwd=str(ROOT), heartbeat_s=0.1, hang_timeout_s=1.0, restart=False,
                stop_timeout_s=1.0)
    return BridgeConfig(**{**base, **kw})


def test_an_8k_frame_never_holds_up_the_hosts_frame_loop(monkeypatch):
    """Point 3: `submit()` of an 8192x8192 frame shrank it on the caller's thread (2-3 s of a frozen frame
    loop). The shrink is held here until the host's calls have returned: they must not wait for it."""
    gate = threading.Event()
    shrink = pixels.limit_size

    def held_shrink(frame, max_side):
        gate.wait(60)
        return shrink(frame, max_side)

    monkeypatch.setattr(pixels, "limit_size", held_shrink)
    frame = np.full((8192, 8192, 3), 9, np.uint8)
    frame[:, 4096:] = 200
    with Bridge(_launched(max_frame_side=1024)) as bridge:
        bridge.wait_running(30)
        returned = threading.Event()

        def frame_loop():
            bridge.submit(frame)
            bridge.latest()
            bridge.submit(frame)  # a second one while the first is still being shrunk: latest wins
            bridge.latest()
            returned.set()

        threading.Thread(target=frame_loop, daemon=True).start()
        try:
            assert returned.wait(30), "submit() or latest() waited for the shrink"
        finally:
            gate.set()
        assert bridge.wait_for_output(bridge.last_seq, 30)
        out, status = bridge.latest()
        assert out.shape == (1024, 1024, 3) and not status.fallback
        assert (out[:, :512] == 9).all() and (out[:, 512:] == 200).all()
        assert bridge.stats()["dropped"] == 1  # the first frame, replaced before it reached the engine
        nan = np.full((8192, 8192, 3), np.nan, np.float32)
        assert bridge.submit(nan) is False  # refused off the caller's thread, and counted
        assert wait_until(lambda: bridge.stats()["refused_frames"] == 1, 30)
        assert "NaN" in bridge.stats()["last_error"]
