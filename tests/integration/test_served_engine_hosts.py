"""The TouchDesigner operator and the ComfyUI nodes reach an engine `loom serve --bind` runs on this
machine: with its session secret file they stream through it; without one, or with an address where
nothing listens, they say so at once (a served engine silently refuses a host without the secret, so
a host that tried anyway would wait for a handshake that never comes)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.fakes.comfyui import engine_node, image_batch, loaded_node_package, run_node
from tests.fakes.touchdesigner import InputTOP, configure, cook_until_running, make_component, td_texture

ROOT = Path(__file__).resolve().parents[2]


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
    serve = subprocess.Popen([sys.executable, "-m", "plugin.cli", "serve", "--bind", endpoint, "--secret-file",
                              str(secret), "--passthrough"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
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
