"""The TouchDesigner operator and the ComfyUI nodes reach an engine `loom serve --bind` runs on this
machine: with its session secret file they stream through it; without one, with another secret file,
or with an address where nothing listens, they say so at once and once (a served engine refuses a host
without the secret during ZMQ's handshake and sends it nothing: only the socket monitor tells)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

import loom_live.host_bridge.supervisor
from loom_live.engine.config import load_config
from loom_live.engine.server.core import EngineServer
from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.host_bridge import Bridge, BridgeConfig, EngineRefused, EngineState
from loom_live.host_bridge.wire.channel import Channel, SharedSecret, read_secret_file
from loom_live.host_bridge.wire.protocol import make
from tests.fakes.comfyui import engine_node, image_batch, loaded_node_package, run_node
from tests.fakes.engines import ConfigSessions, InProcessEngine, wait_until
from tests.fakes.touchdesigner import InputTOP, configure, cook_until, cook_until_running, make_component, td_texture

ROOT = Path(__file__).resolve().parents[2]
HANDSHAKE_TIMEOUT_S = 20.0  # the bridge's default wait for a hello: a refusal must be known well before it
REFUSED = "refused this host's session secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A pass-through engine served on loopback with a session secret: (endpoint, secret file)."""
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    secret = tmp_path_factory.mktemp("served") / "secret"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    serve = subprocess.Popen([sys.executable, "-m", "loom_live.plugin.cli", "serve", "--bind", endpoint,
                              "--secret-file", str(secret), "--passthrough"], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 60
    while serve.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            break
        time.sleep(0.1)
    try:
        assert serve.poll() is None and secret.exists(), "loom serve did not come up"
        yield endpoint, str(secret)
    finally:
        serve.terminate()
        serve.communicate(timeout=30)


@pytest.fixture
def other_secret(tmp_path) -> str:
    """A valid session secret file (mode 600) that is not the served engine's."""
    path = tmp_path / "other.secret"
    read_secret_file(str(path), create=True)
    return str(path)


def refusal_of(endpoint: str) -> str:
    return (f"the engine at {endpoint} refused this host's session secret (is the secret file given to this "
            "host the one its `loom serve --secret-file` uses?)")


def test_a_bridge_with_another_secret_file_is_dead_at_once_and_never_tries_again(served, other_secret, monkeypatch):
    endpoint, _ = served
    opened = []
    real_open = loom_live.host_bridge.supervisor.open_link

    def counting_open(*args, **kwargs):
        opened.append(1)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(loom_live.host_bridge.supervisor, "open_link", counting_open)
    cfg = BridgeConfig(launch=False, endpoint=endpoint, secret_file=other_secret, transport="tcp",
                       restart_backoff_s=0.05)
    bridge = Bridge(cfg).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineRefused) as refused:
            bridge.wait_running(HANDSHAKE_TIMEOUT_S * 2)
        assert time.monotonic() - t0 < HANDSHAKE_TIMEOUT_S / 2  # told by the handshake, not by a timeout
        assert str(refused.value) == refusal_of(endpoint)
        time.sleep(0.5)  # ten restart backoffs: a restart would have begun by now
        status = bridge.status()
        assert status.state == EngineState.DEAD and status.restarts == 0 and len(opened) == 1
        assert status.message == status.refusal == refusal_of(endpoint)
    finally:
        bridge.close()
    with Bridge(BridgeConfig(launch=False, endpoint=endpoint, secret_file=served[1], transport="tcp")) as right:
        assert right.wait_running(30).refusal == ""  # the engine still takes the host that holds its secret


@pytest.mark.parametrize("mode", ["lossless", "live"])
def test_play_with_another_secret_file_exits_2_with_one_line_saying_so(served, other_secret, tmp_path, mode):
    endpoint, _ = served
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "play", "-n", "4", "--size", "32x32", "-o",
                          str(tmp_path / "out.mp4"), "--mode", mode, "--endpoint", endpoint, "--secret-file",
                          other_secret, "--passthrough"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=env)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count(REFUSED) == 1 and refusal_of(endpoint) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "restarting" not in out.stderr


def test_touchdesigner_shows_a_refused_secret_file_and_stays_dead(served, other_secret):
    endpoint, _ = served
    comp, script, ext = make_component(InputTOP(td_texture(8, 8)))
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Endpoint = endpoint
    comp.par.Secretfile = other_secret
    comp.parexec_enabled = True
    ext.Start()
    try:
        cook_until(script, lambda: comp.par.State.eval() == "dead", "engine dead", timeout_s=HANDSHAKE_TIMEOUT_S)
        time.sleep(0.6)  # longer than the restart backoff: a restart would have begun by now
        script.cook()
        assert comp.par.State.eval() == "dead" and ext.bridge.status().restarts == 0
        assert comp.par.Message.eval() == refusal_of(endpoint)
    finally:
        ext.Stop()


def test_comfyui_says_a_refused_secret_file_once(served, other_secret):
    endpoint, _ = served
    with loaded_node_package() as package:
        with pytest.raises(RuntimeError) as failed:  # the Engine node waits for its engine: it says so
            engine_node(package, endpoint=endpoint, secret_file=other_secret)
        assert str(failed.value) == f"Loom Engine: {refusal_of(endpoint)}"
        (handle,) = package.nodes.ENGINES._engines.values()
        assert handle.bridge.status().restarts == 0


def test_touchdesigner_streams_through_a_served_engine_with_its_secret_file(served):
    endpoint, secret = served
    comp, script, ext = make_component(InputTOP(td_texture(16, 16)))
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Endpoint = endpoint
    comp.parexec_enabled = True
    ext.Start()
    assert ext.bridge is None and comp.par.State.eval() == "error"  # no secret file: said now, no wait
    assert "Secret File" in comp.par.Message.eval()
    comp.parexec_enabled = False
    comp.par.Secretfile = secret
    comp.parexec_enabled = True
    ext.Start()
    try:
        cook_until_running(script, comp)
        assert ext.bridge.config.secret_file == secret and not ext.bridge.config.launch
    finally:
        ext.Stop()
        # the served engine takes one host at a time: the next test's host must find this one gone
        assert ext.WaitClosed()


def test_touchdesigner_says_when_nothing_listens_at_the_endpoint(served, tmp_path):
    _, secret = served
    comp, script, ext = make_component(InputTOP(td_texture(8, 8)))
    configure(comp)
    comp.parexec_enabled = False
    comp.par.Endpoint = f"tcp://127.0.0.1:{_free_port()}"
    comp.par.Secretfile = secret
    comp.parexec_enabled = True
    ext.Start()
    assert ext.bridge is None and "no engine answers there" in comp.par.Message.eval()


def test_comfyui_streams_through_a_served_engine_with_its_secret_file(served):
    endpoint, secret = served
    with loaded_node_package() as package:
        with pytest.raises(ValueError, match="give secret_file FILE"):
            engine_node(package, endpoint=endpoint)
        handle, _ = engine_node(package, endpoint=endpoint, secret_file=secret)
        images = image_batch(5, 24, 32)
        out, status = run_node(package, "LoomStream", engine=handle, images=images)
        assert isinstance(out, torch.Tensor) and torch.equal(out, images)
        assert np.isfinite(out.numpy()).all() and "running" in status


def test_comfyui_refuses_an_override_a_served_engine_never_reads_before_it_connects():
    """A served engine runs its own config: an Engine node override of another key is named on the node, not
    dropped without a word (nothing listens at this endpoint: the refusal comes before the node connects). It is
    said in the node's own inputs (overrides, endpoint): a ComfyUI user has no `--set` or `--endpoint` to leave out."""
    with loaded_node_package() as package:
        with pytest.raises(ValueError) as refused:
            engine_node(package, endpoint="tcp://127.0.0.1:9",
                        overrides="noise.noise_scale=0.5\n\n  model.dtype=float16")
        said = str(refused.value)
        assert said.startswith("Loom Engine: overrides line 3: 'model.dtype=float16' is not allowed while endpoint "
                               "is set: a served engine runs its own config, and only the live parameters reach it "
                               "(stream.steps, "), said
        assert "noise.noise_scale" in said and "and prompt.text;" in said, said
        assert said.endswith("set model.dtype in the config the engine is served with, or clear endpoint to start a "
                             "local engine"), said
        assert "--set" not in said and "--endpoint" not in said, said
        with pytest.raises(ValueError, match=r"\(did you mean 'noise.noise_scale'\?\); set noise.noise_scal in "):
            engine_node(package, endpoint="tcp://127.0.0.1:9", overrides="noise.noise_scal=0.5")
        assert len(package.nodes.ENGINES) == 0


@pytest.mark.parametrize(("overrides", "said"), [
    ("noise.noise_scale=0.5\n\n  stream.steps=[9999]",
     "Loom Engine: overrides line 3: stream.steps[0]: 9999 is not allowed; expected a value in [1, 999]"),
    ("stream.steps=[700,\nnoise.noise_scale=0.5", "Loom Engine: overrides line 1: not valid YAML at line 1, column 6: "
                                                  "expected the node content, but found '<stream end>'"),
    ("noise.noise_scale=0.5\nprompt.text=", "Loom Engine: overrides line 2: prompt.text: None is not allowed; "
                                             "expected a string"),
])
def test_comfyui_names_an_override_value_a_served_engine_refuses_by_its_line(overrides, said):
    """A live parameter's value not allowed, no YAML, or a first prompt the config would refuse, is named on the
    Engine node by its overrides line (blank lines counted), before the node connects: a ComfyUI user has no
    `--set` (the prompt's was "preset default (with --set overrides)")."""
    with loaded_node_package() as package:
        with pytest.raises(ValueError) as refused:
            engine_node(package, endpoint="tcp://127.0.0.1:9", overrides=overrides)
        assert str(refused.value) == said
        assert len(package.nodes.ENGINES) == 0


def test_comfyui_tells_a_served_engine_the_overrides_prompt_and_live_parameters_for_every_run():
    """The Engine node's prompt.text and live parameters reach the served engine, and stay this wire's wishes: the
    Stream node does not put them back to what the engine started on."""
    sessions = ConfigSessions(load_config("default"))
    with InProcessEngine(sessions, start=sessions.start) as engine, loaded_node_package() as package:
        handle, _ = engine_node(package, endpoint=engine.endpoint, secret_file=engine.secret_file,
                                overrides="noise.noise_scale=0.5\nprompt.text=ink wash")
        images = image_batch(2, 16, 16)
        out, _ = run_node(package, "LoomStream", engine=handle, images=images)
        [session] = sessions.built
        assert torch.equal(out, images) and session.refused == []
        assert session.params["noise_scale"] == 0.5 and session.prompt == "ink wash"


def test_comfyui_refuses_a_live_parameter_the_served_engine_does_not_take_naming_those_it_does():
    """An edit model's parameter for a Wan engine: refused on the Engine node with what the engine takes, before
    any override is sent (the engine is not left half told)."""
    sessions = ConfigSessions(load_config("default"))
    with InProcessEngine(sessions, start=sessions.start) as engine, loaded_node_package() as package:
        with pytest.raises(ValueError, match=rf"^Loom Engine: overrides: the engine at {engine.endpoint} does not "
                                             r"take adapter_strength; it takes .*noise_scale"):
            engine_node(package, endpoint=engine.endpoint, secret_file=engine.secret_file,
                        overrides="noise.noise_scale=0.5\nedit.adapter_strength=0.6")
        [session] = sessions.built
        assert session.params == {} and session.refused == []


def _engine_report(bridge: Bridge, timeout_s: float = 10.0) -> dict:
    """The engine's stats as this bridge last polled them (it polls once it is running)."""
    deadline = time.monotonic() + timeout_s
    while not bridge.stats()["engine"] and time.monotonic() < deadline:
        time.sleep(0.05)
    report = bridge.stats()["engine"]
    assert report, "no stats from the engine"
    return report


def test_a_host_connecting_while_another_is_attached_gets_in_soon_after_its_bye(served):
    """A TouchDesigner Stop then Start: the new host says hello before the old one's bye arrives; it is
    let in within about a second of that bye, not after the handshake timeout, and the hellos it repeats
    while it waits are not refusals piling up in the engine's stats."""
    endpoint, secret = served
    cfg = BridgeConfig(launch=False, endpoint=endpoint, secret_file=secret, transport="tcp")
    first = Bridge(cfg).start()
    second = None
    try:
        first.wait_running(30)
        refused_before = _engine_report(first)["refused"]
        second = Bridge(cfg).start()
        time.sleep(2.5)  # the second host says hello again and again while the first is attached
        assert second.status().state != EngineState.RUNNING
        assert second.stats()["messages"]["control_sent"] >= 3  # hellos, and nothing else before an answer
        t0 = time.monotonic()
        first.close()
        second.wait_running(HANDSHAKE_TIMEOUT_S)
        assert time.monotonic() - t0 < 8.0  # well under the handshake timeout even on a loaded box
        frames = [np.full((16, 24, 3), i * 40, np.uint8) for i in range(4)]
        out = second.process(frames, timeout_s=30)
        assert all(np.array_equal(a, b) for a, b in zip(out, frames, strict=True))
        # refused as a second host while the first was attached, and counted once, not once per hello
        report = _engine_report(second)
        assert report["refused"] == refused_before + 1 and "second host" in report["last_refusal"]
        assert second.status().restarts == 0
    finally:
        first.close()
        if second is not None:
            second.close()


def test_each_hosts_session_is_closed_when_that_host_leaves():
    """A served engine builds a session per host: the one a host leaves must be closed (its GPU memory; a
    pipeline's rank processes and process group, which the next host's session cannot start beside)."""
    built: list[PassthroughSession] = []
    closed: list[PassthroughSession] = []

    class Counted(PassthroughSession):
        def __init__(self) -> None:
            super().__init__()
            built.append(self)

        def close(self) -> None:
            closed.append(self)
            super().close()

    with InProcessEngine(Counted) as engine:
        for host in range(1, 4):
            with Bridge(BridgeConfig(transport="shm", **engine.host)) as bridge:
                bridge.wait_running(30)
                bridge.process([np.zeros((8, 8, 3), np.uint8)] * 2, timeout_s=30)
                assert closed == built[:host - 1]  # the session in use stays open
            assert wait_until(lambda n=host: len(closed) == n, 10), (len(built), len(closed))
        assert closed == built


def test_a_hello_the_attached_host_repeats_before_the_answer_starts_nothing(tmp_path):
    """Said again before the engine's answer arrived, a host's hello neither starts a second session or
    lane nor counts as a refusal; once the host has spoken, a hello from it is refused, counted once however
    often it is repeated, and still starts nothing."""
    secret = read_secret_file(str(tmp_path / "secret"), create=True)
    server = EngineServer(PassthroughSession, bind="tcp://127.0.0.1:*", curve=SharedSecret(secret, server=True))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    ctx = zmq.Context()
    host = None
    try:
        deadline = time.monotonic() + 10
        while server.channel is None and time.monotonic() < deadline:
            time.sleep(0.02)
        host = Channel(ctx, server.channel.endpoint, bind=False, curve=SharedSecret(secret, server=False))
        hello = make("hello", role="host", token=secret, pid=os.getpid(), transports=["tcp"])
        for _ in range(3):
            host.send(hello)
        received: list[str] = []
        deadline = time.monotonic() + 10
        while "ready" not in received and time.monotonic() < deadline:
            received += [m["type"] for m, _ in host.poll(0.05)]
        worker = server.worker
        host.send(hello)  # still before the host said anything else
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            received += [m["type"] for m, _ in host.poll(0.05)]
        assert received.count("hello") == 1 and received.count("ready") == 1, received
        assert server.worker is worker and server.channel.refused == 0
        host.send(make("heartbeat", t=time.time()))
        for _ in range(3):
            host.send(hello)
        deadline = time.monotonic() + 10
        while server.channel.refused == 0 and time.monotonic() < deadline:
            host.poll(0.05)
        host.poll(0.3)
        assert server.channel.refused == 1 and "after its handshake" in server.channel.last_refusal
        assert server.worker is worker
    finally:
        if host is not None:
            host.close()
        server.request_stop()
        thread.join(10)
        ctx.term()
