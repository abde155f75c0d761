"""Protocol fuzzing: 10,000+ random and mutated messages (over-long numbers and deep nesting among them)
against a real engine server process, before and after its handshake, and against a Bridge client, on
the control channel and the frame lane; neither crashes nor hangs, and every refusal is counted. A refused
request that carries an id is answered with the refusal, and nothing else is."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq

from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.host_bridge import Bridge, BridgeConfig
from loom_live.host_bridge.wire.channel import SharedSecret, apply_curve_keys, read_secret_file
from loom_live.host_bridge.wire.protocol import PROTOCOL_VERSION, ProtocolError, decode, encode, make
from tests.fakes.engines import GuardedSockets, InProcessEngine

ROOT = Path(__file__).resolve().parents[2]
N_MESSAGES = 10_000
RING = dict(transport="shm", dir="in", slots=3, width=8, height=8, channels=3, dtype="uint8", pitch=24,
            generation=1, handles=["loom_00000000deadbeef"])
TEMPLATES = [
    make("hello", role="host", token="abc", pid=1), make("heartbeat", t=1.0), make("ring", id=1, spec=RING),
    make("frame", dir="in", slot=0, seq=1, gen=1), make("release", dir="out", slot=1, gen=1),
    make("prompt", id=2, text="x"), make("params", id=3, params={"steps": [700]}), make("mode", lossless=True),
    make("flush", id=4), make("stats", id=5), make("error", code="c", message="m"), make("bye"),
    make("ready", info={}), make("status", state="running"),
]
JUNK = [None, True, -1, 2**70, 1e308, "", "x" * 300, [], {}, [1, "a"], {"k": [None]}, 3.5]


def _long_number(rng: random.Random) -> bytes:
    digits = str(rng.getrandbits(3400)).encode()[:rng.choice([309, 400, 1000])] * rng.choice([1, 5])
    return rng.choice([b"", b"-"]) + b"1" + digits + rng.choice([b"", b".5", b"e999", b"e-999"])


def _mutate(rng: random.Random) -> list[bytes]:
    choice = rng.randrange(12)
    base = dict(rng.choice(TEMPLATES))
    if choice == 10:  # a number field (or any field) holding a number no float can hold
        keys = [k for k in base if k not in ("type",)]
        base[rng.choice(keys)] = "@NUMBER@"
        return [json.dumps(base).encode().replace(b'"@NUMBER@"', _long_number(rng))]
    if choice == 11:  # deep nesting inside a field, balanced, under the size limit
        depth = rng.randrange(3000, 20_000)  # past the parser's recursion limit in any process
        open_, close = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
        inner = open_ * depth + b"1" + close * depth
        return [b'{"v":%d,"type":"params","id":1,"params":{"x":' % PROTOCOL_VERSION + inner + b"}}"]
    if choice == 0:
        return [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))]
    if choice == 1:
        base["v"] = rng.choice([PROTOCOL_VERSION + 1, 0, "1", None, 1.0 + 1e-9])
    elif choice == 2:
        base["type"] = rng.choice(["", "HELLO", "frame ", "shutdown", 7, None])
    elif choice == 3:
        base[rng.choice(["evil", "__proto__", "payload", "Slot"])] = rng.choice(JUNK)
    elif choice == 4:
        keys = [k for k in base if k not in ("v", "type")]
        if keys:
            base[rng.choice(keys)] = rng.choice(JUNK)
        else:
            base["v"] = -5
    elif choice == 5:
        return [b"[" * rng.randrange(2000, 30000)]
    elif choice == 6:
        return [encode(make("bye", reason="r"))[:-2] + b"y" * 70_000 + b'"}']
    elif choice == 7:
        data = json.dumps(base).encode()
        cut = rng.randrange(1, len(data))
        return [data[:cut] + bytes([rng.getrandbits(8)]) + data[cut + 1:]]
    elif choice == 8:
        return [json.dumps(base).encode(), b"unexpected part", b"another"]
    else:
        return [json.dumps(rng.choice([base, [base], "str", 12, None])).encode().replace(b"1.0", b"NaN")]
    return [json.dumps(base).encode()]


def fuzz_messages(seed: int, n: int) -> list[list[bytes]]:
    """n messages that a correct receiver must refuse (mutations that stay valid are skipped)."""
    rng = random.Random(seed)
    out: list[list[bytes]] = []
    while len(out) < n:
        parts = _mutate(rng)
        try:
            decode(parts)
        except ProtocolError:
            out.append(parts)
    return out


def _recv(sock: zmq.Socket, kind: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decode(sock.recv_multipart())
            if msg["type"] == kind:
                return msg
    raise AssertionError(f"no {kind} message within {timeout_s} s")


def _lane_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def test_engine_server_survives_fuzzing_and_counts_refusals(tmp_path):
    early, messages = fuzz_messages(3, 200), fuzz_messages(1, N_MESSAGES)  # made before the clock runs
    ctx = zmq.Context()
    host = _lane_socket(ctx, f"ipc://{tmp_path}/ctl")
    lane = _lane_socket(ctx, f"ipc://{tmp_path}/lane")
    env = {**os.environ, "LOOM_BRIDGE_TOKEN": "secret", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "loom_live.engine", "serve", "--connect", f"ipc://{tmp_path}/ctl",
                             "--passthrough", "--parent-pid", str(os.getpid())], cwd=ROOT, env=env)
    try:
        assert _recv(host, "hello")["role"] == "engine"
        for parts in early:  # before the handshake: refused too, never fatal
            host.send_multipart(parts)
        host.send(encode(make("hello", role="host", token="secret", pid=os.getpid(), lane=f"ipc://{tmp_path}/lane")))
        _recv(host, "ready")
        for i, parts in enumerate(messages):
            (lane if i % 10 == 0 else host).send_multipart(parts)  # every tenth on the frame lane
            if i % 1000 == 0:
                host.send(encode(make("heartbeat", t=time.time())))
        wrong = [make("frame", dir="in", slot=0, seq=1, gen=1), make("release", dir="out", slot=0, gen=1)]
        for msg in wrong:  # valid frame messages, on the control channel: refused
            host.send(encode(msg))
        lane.send(encode(make("frame", dir="out", slot=0, seq=1, gen=1)))  # the engine's own direction: refused
        expected = len(early) + len(messages) + len(wrong) + 1
        deadline = time.monotonic() + 20
        stats = {}
        while stats.get("refused") != expected and time.monotonic() < deadline:
            host.send(encode(make("stats", id=99)))
            stats = _recv(host, "stats")["data"]
        assert stats["refused"] == expected, stats["last_refusal"]
        assert proc.poll() is None
        host.send(encode(make("params", id=7, params={"noise_scale": 0.5})))
        assert _recv(host, "ack")["id"] == 7  # still serving normally
        host.send(encode(make("bye", reason="test over")))
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        host.close()
        lane.close()
        ctx.term()


def test_bridge_client_survives_fuzzing_and_counts_refusals(tmp_path):
    messages = fuzz_messages(2, N_MESSAGES)  # made first: the bridge would judge the silence meanwhile a hang
    ctx = zmq.Context()
    guard = GuardedSockets(ctx, tmp_path)
    engine, port = guard.bind()
    lane, lane_port = guard.bind()
    bridge = Bridge(BridgeConfig(launch=False, endpoint=f"tcp://127.0.0.1:{port}", transport="tcp", restart=False,
                                 secret_file=guard.secret_file)).start()  # tcp: a frame lane (shm has a doorbell)
    try:
        assert _recv(engine, "hello")["role"] == "host"
        engine.send(encode(make("hello", role="engine", token="", pid=os.getpid(), transports=["tcp"],
                                lane=f"tcp://0.0.0.0:{lane_port}")))  # a wildcard bind: the host keeps its address
        engine.send(encode(make("ready", info={})))
        bridge.wait_running(10)
        for i, parts in enumerate(messages):
            (lane if i % 10 == 0 else engine).send_multipart(parts)
            if i % 500 == 0:
                engine.send(encode(make("heartbeat", t=time.time())))
                t0 = time.monotonic()
                bridge.submit(np.zeros((8, 8, 3), np.uint8))
                frame, status = bridge.latest()
                # a call that waited on the I/O thread's backlog of garbage would take seconds
                assert time.monotonic() - t0 < 1.0 and frame is not None
        engine.send(encode(make("frame", dir="out", slot=0, seq=1, gen=1)))  # valid, but on the control channel
        expected = len(messages) + 1
        deadline = time.monotonic() + 15
        while bridge.stats()["refused"] < expected and time.monotonic() < deadline:
            engine.send(encode(make("heartbeat", t=time.time())))
            time.sleep(0.05)
        stats = bridge.stats()
        assert stats["refused"] == expected, stats["last_refusal"]
        assert bridge.status().state == "running"
        assert _recv(lane, "frame")["dir"] == "in"  # the host's frames came on the lane
    finally:
        bridge.close()
        guard.close()
        ctx.term()


def test_the_engine_answers_a_request_it_refuses_under_its_id_and_nothing_else():
    """A refused request was never answered, so a host waiting on its id timed out without the reason. The
    attached host's refused request with a valid id gets `error` with that id and the refusal at once; one
    without an id or with an id the schema refuses, a refused reply, anything before hello and a waiting host's
    request get nothing. A request that fails where the engine acts on it is answered alike."""
    bad_params = {"v": PROTOCOL_VERSION, "type": "params", "params": {"noise_scale": 7}}
    blank = {"v": PROTOCOL_VERSION, "type": "prompt", "text": " "}
    ctx = zmq.Context()
    host, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock in (host, other):
        sock.setsockopt(zmq.LINGER, 0)
    try:
        with InProcessEngine(PassthroughSession) as engine:
            secret = read_secret_file(engine.secret_file)
            apply_curve_keys(host, SharedSecret(secret, server=False))
            host.connect(engine.endpoint)
            host.send(json.dumps({**bad_params, "id": 1}).encode())  # before hello: nobody's host yet
            host.send(encode(make("hello", role="host", token=secret, pid=os.getpid(), transports=["tcp"])))
            _recv(host, "ready")
            for msg in (blank, {**blank, "id": None}, {**bad_params, "id": "3"}, {**bad_params, "id": -4},
                        {"v": PROTOCOL_VERSION, "type": "ack", "id": 5, "extra": 1},
                        {**blank, "id": 6}, {**bad_params, "id": 7}):
                host.send(json.dumps(msg).encode())
            host.send_multipart([encode(make("reset", id=8)), b"an unexpected part"])
            errors = [_recv(host, "error") for _ in range(3)]
            assert [(e["id"], e["code"]) for e in errors] == [(6, "prompt"), (7, "params"), (8, "reset")]
            assert "prompt.text: the prompt is empty" in errors[0]["message"]
            assert errors[1]["message"].startswith("params.params: ") and "noise_scale: '7' is not allowed" \
                in errors[1]["message"]
            assert errors[2]["message"] == "reset: 2 parts; expected 1"
            host.send(encode(make("stats", id=9)))
            stats = _recv(host, "stats")
            assert stats["id"] == 9 and stats["data"]["refused"] == 9  # each still counted, the last one said
            assert stats["data"]["last_refusal"] == errors[2]["message"]
            host.send(encode(make("params", id=10, params={"noise_scale": 0.5})))
            assert _recv(host, "ack")["id"] == 10  # serving as before
            worker, post = engine.server.worker, engine.server.worker.post

            def failing(kind: str, *args: object) -> None:  # a request that fails where it is acted on
                if kind == "flush":
                    raise RuntimeError("the session broke")
                post(kind, *args)

            worker.post = failing
            host.send(encode(make("flush", id=13)))
            failed = _recv(host, "error")
            assert (failed["id"], failed["code"]) == (13, "flush") and "the session broke" in failed["message"]
            worker.post = post
            apply_curve_keys(other, SharedSecret(secret, server=False))
            other.connect(engine.endpoint)  # another host that holds the secret: it only hears that it waits
            other.send(json.dumps({**blank, "id": 11}).encode())
            other.send(encode(make("hello", role="host", token=secret, pid=os.getpid() + 1, transports=["tcp"])))
            assert other.poll(20_000) and decode(other.recv_multipart())["type"] == "wait"  # answered first
            host.send(encode(make("stats", id=12)))  # its request's answer went to the attached host neither
            kinds: list[str] = []
            while kinds[-1:] != ["stats"]:
                assert host.poll(20_000)
                kinds.append(decode(host.recv_multipart())["type"])
            assert "error" not in kinds, kinds
    finally:
        host.close()
        other.close()
        ctx.term()
