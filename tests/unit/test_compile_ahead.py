"""Compiling the VAE's steps ahead: a helper meets exactly the steps the session's warm-up meets (so its
graphs are the ones the engine asks the caches for), and the engine's first compile of a step waits for
the helpers, whatever became of them."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from loom_live.engine.config import load_config
from loom_live.engine.graphs.saved_compiles import signature
from loom_live.engine.models import wan_vae
from loom_live.engine.models.wan_vae import VAE_PRESETS, WanVAE
from loom_live.engine.stream import compile_ahead
from loom_live.engine.stream.compile_ahead import CompileAhead, compile_direction
from loom_live.engine.stream.session import StreamSession

SMALL = ["resolution.width=64", "resolution.height=64", "model.device=cpu"]


def test_a_helper_meets_the_vae_steps_the_session_s_warm_up_meets(monkeypatch):
    """Every steady encoder and decoder call (the compiled steps on a GPU), keyed as a compile is keyed:
    the input's and the histories' shapes, strides and dtypes. On a CPU both run the VAE as a CPU session
    lays it out; the layout code they share on a GPU is one function (`lay_out_wan_vae`)."""
    seen: dict[str, set] = {"session": set(), "helper": set()}
    who = ["session"]
    for part in (wan_vae.Encoder, wan_vae.Decoder):
        def record(self, x, cache, _forward=part.forward, _name=part.__name__):
            if cache.started:
                seen[who[0]].add((_name, signature((x, cache))))
            return _forward(self, x, cache)
        monkeypatch.setattr(part, "forward", record)
    cfg = load_config("tiny-random", SMALL)
    session = StreamSession.from_config(cfg, warmup=False)
    session.warmup()  # every plan the scheduler may pick, as on a GPU
    session.close()
    who[0] = "helper"
    for direction in ("encode", "decode"):
        compile_direction(cfg, direction)
    assert {name for name, _ in seen["session"]} == {"Encoder", "Decoder"}
    assert seen["helper"] == seen["session"]


def test_a_gpu_without_room_for_helpers_beside_the_engine_compiles_alone(monkeypatch, caplog):
    """A 24 GB card: two helpers' VAEs beside an engine starting up could run it out of memory."""
    monkeypatch.setattr(compile_ahead, "resolve_device", lambda setting: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (22 * 2**30, 24 * 2**30))
    caplog.set_level(logging.INFO, logger="loom_live.engine.stream.compile_ahead")
    assert CompileAhead.start(load_config("tiny-random", ["vae.compile_ahead=true"])) is None
    assert "not on this GPU (22.0 GiB free" in caplog.text


def test_nothing_is_compiled_ahead_where_the_engine_would_not_compile_the_vae_whole():
    assert CompileAhead.start(load_config("tiny-random", ["vae.compile_ahead=true", "model.device=cpu"])) is None
    assert CompileAhead.start(load_config("tiny-random", ["model.device=cuda"])) is None  # the switch off
    assert CompileAhead.start(load_config("tiny-random", ["vae.compile_ahead=true", "vae.saved_steps=none",
                                                          "model.device=cuda"])) is None


def _helper(target, *args) -> multiprocessing.process.BaseProcess:
    helper = multiprocessing.get_context("spawn").Process(target=target, args=args)
    helper.start()
    return helper


@pytest.mark.skipif(sys.platform != "linux", reason="spawned helper processes")
def test_the_first_compile_of_a_step_waits_for_its_helper_and_a_warm_up_marks_the_config(tmp_path, caplog):
    torch.manual_seed(0)
    vae = WanVAE(VAE_PRESETS["tiny"]).eval().requires_grad_(False)
    vae.compile_step(saved=tmp_path / "saved", build_saved=False)
    marker = tmp_path / "ahead" / "config.done"
    ahead = CompileAhead({"encode": _helper(sys.exit, 3), "decode": _helper(time.sleep, 3.0)}, marker)
    ahead.attach(SimpleNamespace(encoder=vae, decoder=vae))
    frames = torch.rand(1, 3, 5, 16, 16) * 2 - 1
    state = vae.new_stream_state()
    caplog.set_level(logging.INFO, logger="loom_live.engine.stream.compile_ahead")
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # the waits, not Inductor's C++ compile
        z = vae.encode_stream(frames[:, :, :1], state)  # a stream's first call: plain, no compile, no wait
        assert ahead.helpers["decode"].is_alive()
        # the first compiled step: its helper failed (said; the step compiles here), and it waits for the
        # decoder's too, whose GPU work would skew the timing of its first steady call
        vae.encode_stream(frames[:, :, 1:], state)
        assert not ahead.helpers["decode"].is_alive()
        vae.decode_stream(z, state)
        vae.decode_stream(z, state)  # nothing left to wait for
    assert "helper failed (exit code 3)" in caplog.text and "the decode step's helper done" in caplog.text
    assert caplog.text.count("compile ahead:") == 2  # each helper heard of once
    ahead.finish(warmed=False)
    assert not marker.exists()
    ahead.finish(warmed=True)
    assert marker.is_file()


@pytest.mark.skipif(sys.platform != "linux", reason="spawned helper processes")
def test_a_start_whose_warm_up_fails_stops_its_helpers(tmp_path, monkeypatch):
    """Helpers left running would hold the failed engine's exit (Python joins its child processes) for as
    long as their compile takes, where its host waits to hear that the start failed."""
    helper = _helper(time.sleep, 60.0)
    monkeypatch.setattr(CompileAhead, "start", classmethod(
        lambda cls, cfg: cls({"encode": helper}, tmp_path / "ahead" / "config.done")))
    build = StreamSession.__init__

    def on_a_gpu(self, *args, **kwargs):  # the warm-up runs on CUDA only
        build(self, *args, **kwargs)
        self.device = SimpleNamespace(type="cuda")

    def out_of_memory(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(StreamSession, "__init__", on_a_gpu)
    monkeypatch.setattr(StreamSession, "warmup", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory"):
        StreamSession.from_config(load_config("tiny-random", SMALL))
    helper.join(10.0)
    assert not helper.is_alive()
    assert not (tmp_path / "ahead" / "config.done").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="helpers compile ahead only on CUDA")
def test_on_a_gpu_the_engine_reads_what_its_helpers_compiled_and_a_warm_start_starts_none(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["LOOM_CACHE_DIR"] = str(tmp_path / "cache")  # a cold compile cache
    runs = []
    for i in range(2):
        out = tmp_path / f"bench{i}.json"
        proc = subprocess.run([sys.executable, "-m", "loom_live.plugin.cli", "bench", "-c", "tiny-random", "--frames",
                               "16", "--bridge", "none", "--no-baseline", "--set", "vae.compile_ahead=true",
                               "--json", str(out)], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append((proc.stderr, json.loads(out.read_text())["loom"]["startup"]))
    (first_log, first), (second_log, _) = runs
    assert "compiling the VAE's steps ahead in 2 helper processes" in first_log, first_log[-3000:]
    assert all(f"the {d} step's helper done" in first_log for d in ("encode", "decode")), first_log[-3000:]
    assert "helper failed" not in first_log and "steps ahead" not in second_log  # marked: a warm start starts none
    assert first["inside"]["warmup"].get("fx_cache_hits", 0) >= 2  # the VAE's steps: the helpers' graphs
    assert list((tmp_path / "cache" / "compiled").glob("*/ahead/*.done"))
