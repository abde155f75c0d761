"""Frame rings (shm, tcp) and endpoints: slots, ownership, cleanup; tcp to a served engine with CurveZMQ."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.auth

from loom_live.host_bridge import Bridge, BridgeConfig, EngineRefused
from loom_live.host_bridge.wire.channel import (
    Channel,
    EndpointError,
    SharedSecret,
    check_endpoint,
    is_loopback,
    read_secret_file,
)
from loom_live.host_bridge.wire.protocol import ProtocolError, make
from loom_live.host_bridge.wire.rings import SlotTracker, TransportUnavailable, attach_ring, create_ring
from loom_live.host_bridge.wire.rings.cuda import cuda_available

ROOT = Path(__file__).resolve().parents[2]


def _frames(n: int, h: int = 24, w: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(n)]


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="POSIX shared memory")
def test_shm_ring_is_private_shared_and_removed_by_its_owner():
    ring = create_ring("shm", "in", slots=3, width=40, height=24, generation=1)
    other = create_ring("shm", "in", slots=3, width=40, height=24, generation=1)
    path = Path("/dev/shm") / ring.spec.handles[0]
    try:
        assert ring.spec.handles != other.spec.handles  # random names
        assert path.stat().st_mode & 0o777 == 0o600
        peer = attach_ring(ring.spec)
        frames = _frames(3)
        for slot, f in enumerate(frames):
            ring.write(slot, f)
        assert all(np.array_equal(peer.read(s, []), f) for s, f in enumerate(frames))
        peer.close()
        assert path.exists()  # the engine only attaches: closing its view removes nothing
        with pytest.raises(ValueError, match="does not fit"):
            ring.write(0, np.zeros((24, 40, 4), np.uint8))
        with pytest.raises(ProtocolError, match="outside the ring"):
            ring.read(3, [])
    finally:
        ring.close()
        other.close()
    assert not path.exists()


@pytest.mark.skipif(not Path("/dev/shm").is_dir() or not hasattr(os, "posix_fallocate"), reason="POSIX shm")
def test_a_shm_ring_dev_shm_cannot_hold_is_refused_at_creation_not_a_sigbus_later(monkeypatch):
    """tmpfs reserves nothing at ftruncate: without taking the pages up front, the first write past what
    /dev/shm holds would kill the host with SIGBUS instead of refusing the frame. Only this process's segments
    are compared, and only for one added: other test processes make and remove their own meanwhile, and this
    one's earlier bridges may remove theirs as they are collected."""
    mine = f"loom_{os.getpid()}_*"
    before = {p.name for p in Path("/dev/shm").glob(mine)}

    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"cannot reserve 2880 bytes .*No space left.*--shm-size.*tcp"):
        create_ring("shm", "in", slots=1, width=40, height=24, generation=1)
    assert {p.name for p in Path("/dev/shm").glob(mine)} - before == set()  # nothing half made is left behind


def test_tcp_ring_raw_is_exact_and_jpeg_is_close():
    f = _frames(1)[0]
    raw = create_ring("tcp", "in", slots=2, width=40, height=24)
    assert np.array_equal(attach_ring(raw.spec).read(0, raw.write(0, f)), f)
    with pytest.raises(ProtocolError, match="payload"):
        raw.read(0, [b"short"])
    smooth = np.tile(np.linspace(0, 255, 40, dtype=np.uint8)[None, :, None], (24, 1, 3))
    jpeg = create_ring("tcp", "out", slots=2, width=40, height=24, encoding="jpeg", jpeg_quality=95)
    payload = jpeg.write(1, smooth)
    assert len(payload[0]) < smooth.nbytes
    back = attach_ring(jpeg.spec).read(1, payload)
    assert np.abs(back.astype(int) - smooth).mean() < 3


def test_slot_tracker_never_hands_out_a_published_slot():
    t = SlotTracker(3)
    slots = [t.acquire() for _ in range(3)]
    for s in slots:
        t.publish(s)
    assert t.acquire() is None and t.in_flight == 3
    assert not t.release(7)  # never published: refused
    assert t.release(slots[1]) and t.acquire() == slots[1]


def test_cuda_ipc_is_optional():
    ok, why = cuda_available()
    if ok:
        pytest.skip("a GPU is present; the gpu tests cover cuda-ipc")
    assert why
    with pytest.raises(TransportUnavailable, match="cuda-ipc transport unavailable"):
        create_ring("cuda-ipc", "in", slots=2, width=8, height=8)
    with Bridge(BridgeConfig(transport="cuda-ipc", passthrough=True)) as bridge:  # a host on a machine without CUDA
        status = bridge.status()
        assert status.state == "dead" and "cuda-ipc transport unavailable" in status.message
        # said "the bridge is not started; call start() first, or use it in a with block" of this started one
        with pytest.raises(RuntimeError, match="engine is dead: cuda-ipc transport unavailable"):
            bridge.wait_running(5)
        with pytest.raises(RuntimeError, match="params: engine is dead: cuda-ipc transport unavailable"):
            bridge.set_params(noise_scale=0.5, wait=True)
        frame = _frames(1)[0]
        assert bridge.submit(frame) is False
        out, status = bridge.latest()
        assert np.array_equal(out, frame) and status.fallback  # the host keeps showing its input
        with pytest.raises(ValueError, match="pitch: 10 bytes is smaller than one row"):
            bridge.submit_cuda(1234, 10, 8, 8, 4, "uint8")
        with pytest.raises(ValueError, match="channels: 2"):
            bridge.submit_cuda(1234, 64, 8, 8, 2, "uint8")


def test_non_loopback_tcp_needs_curve():
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("ipc:///tmp/x") and is_loopback("tcp://localhost:1")
    assert not is_loopback("tcp://10.0.0.2:5555") and not is_loopback("tcp://0.0.0.0:5555")
    with pytest.raises(EndpointError, match="CurveZMQ keys are required"):
        check_endpoint("tcp://192.168.1.20:5555", None)
    bridge = Bridge(BridgeConfig(launch=False, endpoint="tcp://192.168.1.20:5555", restart=False)).start()
    try:
        with pytest.raises(RuntimeError, match="CurveZMQ"):
            bridge.wait_running(5)
    finally:
        bridge.close()
    out = subprocess.run([sys.executable, "-m", "loom_live.engine", "serve", "--bind", "tcp://0.0.0.0:5599",
                          "--passthrough"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "CurveZMQ keys are required" in out.stderr


def test_tcp_transport_through_a_launched_engine_is_lossless_and_ordered():
    frames = _frames(40)
    with Bridge(BridgeConfig(transport="tcp", passthrough=True, engine_cwd=str(ROOT))) as bridge:
        bridge.wait_running(30)
        outs = bridge.process(frames, timeout_s=30)
    assert all(np.array_equal(a, b) for a, b in zip(frames, outs))


def test_a_channel_knows_when_its_peer_refuses_its_session_secret():
    """A peer that refuses the credentials sends nothing at all; the connecting channel learns it from its
    handshake, at once, and one that holds the secret is never taken for refused."""
    ctx = zmq.Context()
    server = Channel(ctx, "tcp://127.0.0.1:*", bind=True, curve=SharedSecret("s" * 32, server=True))
    clients = {secret: Channel(ctx, server.endpoint, bind=False, curve=SharedSecret(secret, server=False))
               for secret in ("w" * 32, "s" * 32)}
    try:
        wrong, right = clients.values()
        right.send(make("heartbeat", t=0.0))
        deadline = time.monotonic() + 10
        got = []
        while (wrong.handshake_refusal is None or not got) and time.monotonic() < deadline:
            for channel in clients.values():
                channel.poll(0.02)
            got += server.poll(0.02)
        assert wrong.handshake_refusal is not None and wrong.handshake_refusal.kind == "credentials"
        assert [m["type"] for m, _ in got] == ["heartbeat"] and right.handshake_refusal is None
    finally:
        for channel in (*clients.values(), server):
            channel.close()
        ctx.term()  # a monitor left open would keep this waiting


def test_served_engine_over_tcp_with_curve_authentication(tmp_path):
    server_dir, client_dir, authorized, stranger_dir = (tmp_path / n for n in ("s", "c", "auth", "x"))
    for d in (server_dir, client_dir, authorized, stranger_dir):
        d.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(str(server_dir), "server")
    client_public, client_secret = zmq.auth.create_certificates(str(client_dir), "client")
    stranger_public, stranger_secret = zmq.auth.create_certificates(str(stranger_dir), "stranger")
    secret = tmp_path / "session.secret"
    read_secret_file(str(secret), create=True)
    os.replace(client_public, authorized / "client.key")
    engine = subprocess.Popen([sys.executable, "-m", "loom_live.engine", "serve", "--bind", "tcp://127.0.0.1:*",
                               "--passthrough", "--curve-secret-file", server_secret, "--curve-authorized",
                               str(authorized)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stderr=subprocess.PIPE, text=True)
    try:
        line = engine.stderr.readline()
        assert "listening on tcp://127.0.0.1:" in line, line
        endpoint = line.split()[-1]
        cfg = dict(launch=False, endpoint=endpoint, transport="tcp", encoding="jpeg", handshake_timeout_s=2.0,
                   curve_server_public_file=server_public)
        with Bridge(BridgeConfig(**cfg, curve_secret_file=client_secret)) as bridge:
            bridge.wait_running(30)
            smooth = np.tile(np.linspace(0, 255, 64, dtype=np.uint8)[None, :, None], (32, 1, 3))
            outs = bridge.process([smooth] * 5, timeout_s=20)
            assert len(outs) == 5 and all(np.abs(o.astype(int) - smooth).mean() < 3 for o in outs)
        # a host the engine will never take is told by the handshake itself, well before the bridge's
        # 2 s handshake timeout, and not restarted (restart is on)
        wrong = {"a key not in --curve-authorized": dict(cfg, curve_secret_file=stranger_secret),
                 "another engine's public key": dict(cfg, curve_secret_file=client_secret,
                                                     curve_server_public_file=stranger_public),
                 "a session secret": dict(launch=False, endpoint=endpoint, transport="tcp", secret_file=str(secret))}
        at = re.escape(f"the engine at {endpoint}")
        expected = {"a key not in --curve-authorized": f"{at} refused this host's CurveZMQ keys",
                    "another engine's public key": f"{at} broke off the handshake with this host's CurveZMQ keys",
                    # which side notices the mismatch first is a race: the other sees the handshake broken off
                    "a session secret": f"{at} (does not take a host's|broke off the handshake with this host's) "
                                        "session secret"}
        for what, settings in wrong.items():
            stranger = Bridge(BridgeConfig(**{**settings, "handshake_timeout_s": 2.0})).start()
            try:
                with pytest.raises(EngineRefused, match=expected[what]):
                    stranger.wait_running(10)
                assert stranger.status().restarts == 0, what
            finally:
                stranger.close()
        assert engine.poll() is None  # the served engine outlives its hosts
    finally:
        engine.terminate()
        assert engine.wait(timeout=10) == 143  # SIGTERM: 128 + 15, as `loom play`


def test_host_bridge_needs_neither_torch_nor_engine_nor_cuda_python():
    code = (
        "import sys\n"
        "sys.modules['cuda'] = None; sys.modules['cuda.bindings'] = None  # as if cuda-python were absent\n"
        "import numpy as np\n"
        "from loom_live.host_bridge import Bridge, BridgeConfig\n"
        "from loom_live.host_bridge.wire.rings import create_ring\n"
        "from loom_live.host_bridge.wire.rings.cuda import cuda_available\n"
        "ok, why = cuda_available(); assert not ok and 'cuda-python' in why, why\n"
        "r = create_ring('shm', 'in', slots=2, width=4, height=4)\n"
        "r.write(0, np.zeros((4, 4, 3), np.uint8)); r.close()\n"
        "assert not any(m == 'torch' or m.startswith(('torch.', 'loom_live.engine')) for m in sys.modules), "
        "'imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
