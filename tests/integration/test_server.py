"""`loom serve` as a user meets it: clear errors, clean exits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom_live.plugin.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom_live.engine", "serve", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_bad_config_fails_before_serving_with_the_key(capsys):
    code = main(["serve", "--connect", "ipc:///nonexistent/x", "--set", "stream.stepz=[700]"])
    assert code == 2
    assert "stream.stepz: unknown key" in capsys.readouterr().err


def test_an_engine_nobody_talks_to_gives_up(tmp_path):
    t0 = time.monotonic()
    out = _serve("--connect", f"ipc://{tmp_path}/nobody", "--passthrough", "--handshake-timeout", "1")
    assert out.returncode == 4 and "no hello from the host" in out.stderr
    assert time.monotonic() - t0 < 30


def test_curve_flags_go_together():
    out = _serve("--bind", "tcp://127.0.0.1:5598", "--curve-secret-file", "x.key_secret")
    assert out.returncode == 2 and "go together" in out.stderr


def test_a_host_waiting_on_a_long_start_sees_each_phase_the_session_says():
    """A first start compiles for a minute or more: the host's status follows the session's phases (what `loom
    play` prints while it waits), not one line the whole time; then the engine runs as usual."""
    import threading

    from loom_live.engine.server.passthrough import PassthroughSession
    from loom_live.engine.startup_progress import STARTUP_PROGRESS
    from loom_live.host_bridge import Bridge, BridgeConfig
    from tests.fakes.engines import InProcessEngine, wait_until

    seen, go_on = threading.Event(), threading.Event()

    def slow_start() -> PassthroughSession:
        STARTUP_PROGRESS.say("compiling and warming up: stream 1 (14 chunks)")
        go_on.wait(20)  # until the host has shown it
        return PassthroughSession()

    with InProcessEngine(slow_start) as engine:
        with Bridge(BridgeConfig(**engine.host)) as bridge:
            if wait_until(lambda: bridge.status().message == "compiling and warming up: stream 1 (14 chunks)", 20):
                seen.set()
            go_on.set()
            assert seen.is_set(), bridge.status()
            bridge.wait_running(20)
    STARTUP_PROGRESS.say("nobody listens: said to no one")  # outside a start: a no-op


def test_the_ready_message_says_the_prompt_and_live_parameters_the_engine_starts_on():
    """`loom serve` names its config's prompt and live parameters in its ready message (`start`), the
    pass-through session's too; a host reads them with `Bridge.engine_start`: what it can go back to. An engine
    that does not say them (an older one) gives None."""
    import argparse

    from loom_live.engine.config import load_config
    from loom_live.engine.server import main as serve
    from loom_live.engine.server.passthrough import PassthroughSession
    from loom_live.host_bridge import Bridge, BridgeConfig
    from tests.fakes.engines import InProcessEngine

    overrides = ["prompt.text=ink wash", "noise.noise_scale=0.5", "control.context_scale=0.7"]
    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--bind", "tcp://127.0.0.1:*", "--passthrough",
                              *(f"--set={o}" for o in overrides)])
    build, start = serve._session_factory(args)
    assert isinstance(build(), PassthroughSession)
    assert start == load_config("default", overrides).start_settings()
    assert start["prompt"] == "ink wash" and start["params"]["steps"] == [700, 500]  # the default preset's
    assert start["params"]["noise_scale"] == 0.5 and start["params"]["context_scale"] == 0.7
    assert start["family"] == "wan"
    for told, expected in ((start, start), (None, None)):
        with InProcessEngine(build, start=told) as engine, Bridge(BridgeConfig(**engine.host)) as bridge:
            bridge.wait_running(20)
            assert bridge.engine_start() == expected
            assert bridge.engine_family == (told and told["family"])


def test_a_host_says_an_empty_prompt_in_the_words_of_the_engine_s_family():
    """An empty prompt sent from TouchDesigner or ComfyUI to an edit engine asked for "a few words describing the
    style": the host did not know the family. The ready message names it (`Bridge.engine_family`); before an
    engine has said, what each family takes is said. The refused prompt is not remembered; a good one is taken."""
    from loom_live.engine.config import load_config
    from loom_live.engine.server.passthrough import PassthroughSession
    from loom_live.host_bridge import Bridge, BridgeConfig
    from tests.fakes.engines import InProcessEngine

    for config, family, takes in (("edit-tiny", "edit", "an instruction, such as 'make it a watercolor painting'"),
                                  ("tiny-random", "wan", "a few words describing the style")):
        with InProcessEngine(PassthroughSession, start=load_config(config).start_settings()) as engine:
            bridge = Bridge(BridgeConfig(**engine.host))
            with pytest.raises(ValueError, match=r"style \(the wan family\) or an instruction.* \(the edit family\)"):
                bridge.set_prompt(" ")  # not started: no engine has said its family
            with bridge:
                bridge.wait_running(20)
                assert bridge.engine_family == family
                for blank in ("", " \n "):
                    with pytest.raises(ValueError) as refused:
                        bridge.set_prompt(blank, wait=True)
                    assert str(refused.value) == f"the prompt is empty; give {takes}"
                assert bridge.wanted.prompt is None
                bridge.set_prompt("make it a charcoal drawing", wait=True)
                assert engine.server.worker.session.prompt == "make it a charcoal drawing"


def test_the_engine_refuses_a_blank_prompt_on_the_wire_in_its_family_s_words():
    """A client that skips the bridge's check sends a blank prompt: the engine's report said it expected "a
    non-empty text of at most 4096 characters", whatever its family. It says what its prompt is (each family's
    words from an engine that does not know its own); the message is refused and counted, and the stream goes on."""
    import numpy as np

    from loom_live.engine.config import load_config
    from loom_live.engine.server.passthrough import PassthroughSession
    from loom_live.host_bridge import Bridge, BridgeConfig
    from loom_live.host_bridge.wire.protocol import PROTOCOL_VERSION
    from tests.fakes.engines import InProcessEngine, engine_report

    edit = "an instruction, such as 'make it a watercolor painting'"
    for start, takes in ((load_config("edit-tiny").start_settings(), edit),
                         (None, f"a few words describing the style (the wan family) or {edit} (the edit family)")):
        with InProcessEngine(PassthroughSession, start=start) as engine, \
                Bridge(BridgeConfig(**engine.host)) as bridge:
            bridge.wait_running(20)
            bridge._link.send({"v": PROTOCOL_VERSION, "type": "prompt", "id": 9, "text": " "})  # as make() refuses it
            report = engine_report(bridge, lambda r: r.get("refused") == 1)
            assert report["last_refusal"] == f"prompt.text: the prompt is empty; give {takes}"
            bridge.set_prompt("make it ink", wait=True)
            assert engine.server.worker.session.prompt == "make it ink"
            frame = np.full((16, 16, 3), 7, np.uint8)
            assert np.array_equal(bridge.process([frame], timeout_s=20)[0], frame)


def test_a_host_waiting_on_a_request_the_engine_s_schema_refuses_hears_the_engine_s_reason(monkeypatch):
    """An engine of another version refuses a parameter value this host allows, at its wire check: nothing
    answered it, so `set_params(wait=True)` waited out its request timeout and said "no reply from the engine".
    It raises the engine's refusal as soon as it comes, nothing is remembered, and the stream goes on."""
    from loom_live.engine.server.passthrough import PassthroughSession
    from loom_live.host_bridge import Bridge, BridgeConfig
    from loom_live.host_bridge.wire import channel
    from loom_live.host_bridge.wire.protocol import ProtocolError, decode
    from tests.fakes.engines import InProcessEngine

    why = "params.params: live parameters (noise_scale: 0.9 is not allowed; expected a number in [0, 0.5])"

    def older_engine_decode(parts: list[bytes], family: str | None = None) -> dict:
        msg = decode(parts, family)
        if msg["type"] == "params" and msg["params"].get("noise_scale", 0) > 0.5:  # only a host sends params
            raise ProtocolError(why)
        return msg

    monkeypatch.setattr(channel, "decode", older_engine_decode)
    with InProcessEngine(PassthroughSession) as engine, \
            Bridge(BridgeConfig(**engine.host, request_timeout_s=60)) as bridge:  # a hang fails, never a slow box
        bridge.wait_running(20)
        with pytest.raises(ValueError) as refused:
            bridge.set_params(noise_scale=0.9, wait=True)
        assert str(refused.value) == f"engine refused params: {why}"
        assert "noise_scale" not in bridge.wanted.params
        assert bridge.stats()["last_error"] == why
        bridge.set_params(noise_scale=0.4, wait=True)
        assert engine.server.worker.session.params["noise_scale"] == 0.4
        assert engine.server.channel.refused == 1
