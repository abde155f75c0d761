"""A standby's warm-up beside a show rests between chunks so that it takes only its share of the time: the
pace itself, the session's warm-up that uses it, the engine's option and the bridge's choice of who gets it."""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
import zmq

from loom_live.engine.stream.warmup_pace import WarmupPace
from loom_live.host_bridge import BridgeConfig
from loom_live.host_bridge.link_open import _engine_args


class _Clock:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_a_chunk_is_followed_by_the_rest_that_makes_the_warm_up_its_share_of_the_time():
    clock = _Clock()
    pace = WarmupPace(0.25, clock=clock, sleep=clock.sleep)
    for worked in (1.0, 2.0):  # the time since the last rest, not since the start
        clock.now += worked
        pace.chunk_done()
    assert clock.slept == [3.0, 6.0] and pace.rested_s == 9.0
    whole = WarmupPace(1.0, clock=clock, sleep=clock.sleep)
    clock.now += 5.0
    whole.chunk_done()
    assert clock.slept == [3.0, 6.0] and whole.rested_s == 0.0


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused_naming_what_is_allowed(share):
    with pytest.raises(ValueError, match="allowed above 0 up to 1"):
        WarmupPace(share)


def test_a_stream_session_warm_up_with_a_share_rests_and_warms_the_same_plans():
    from loom_live.engine.config import load_config
    from loom_live.engine.models.loading import load_models
    from loom_live.engine.stream.session import StreamSession

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = load_config("default", ["resolution.width=64", "resolution.height=64", "stream.mode=batch"])
        session = StreamSession(cfg, load_models(cfg))
        session.warmup(streams=1, chunks=3, share=0.5)
        assert session._warm_pace.rested_s > 0.0
        assert session.warmed_plans == session.warmup_plans()
        frames = np.random.default_rng(0).integers(0, 256, (9, 64, 64, 3), np.uint8)
        assert len(session.push(frames)) + len(session.flush()) == 9  # a fresh stream after it, as without rests
    finally:
        torch.set_num_threads(threads)


def test_the_launched_engine_is_told_its_share_whenever_it_is_below_one():
    """An engine on a GPU warms up whether or not the bridge asks it to (`engine_warmup`): the share paces that
    warm-up either way (it was told only with engine_warmup, so a default bridge's standby warmed up whole)."""
    for cfg in (BridgeConfig(), BridgeConfig(engine_warmup=True)):
        assert _engine_args(cfg, "ipc://x", 0.3)[-2:] == ["--warmup-share", "0.3"]
        assert "--warmup-share" not in _engine_args(cfg, "ipc://x")


@pytest.mark.parametrize(("beside_show", "share"), [(True, 0.3), (False, 1.0)],
                         ids=["launched-while-an-engine-serves", "launched-with-the-first-engine"])
def test_a_standby_launched_while_an_engine_serves_gets_the_configured_share(monkeypatch, beside_show, share):
    from loom_live.host_bridge import standby as standby_module

    shares = []

    def fake_open(ctx, cfg, link_ids, lock, warmup_share=1.0):
        shares.append(warmup_share)
        raise standby_module.LinkOpenError("not launched in this test")

    monkeypatch.setattr(standby_module, "open_link", fake_open)
    ctx = zmq.Context()
    try:
        standby = standby_module.Standby(BridgeConfig(standby=True, engine_warmup=True), ctx, threading.RLock(),
                                         itertools.count())
        standby.step(open_new=True, beside_show=beside_show)
    finally:
        ctx.term()
    assert shares == [share]


def test_the_standby_share_is_checked_when_the_config_is_made():
    with pytest.raises(ValueError, match="standby_warmup_share"):
        BridgeConfig(standby_warmup_share=0.0)


@pytest.mark.parametrize(("args", "said"), [
    (["--warmup", "--warmup-share", "0"], "--warmup-share 0: allowed above 0 up to 1"),
    (["--warmup-share", "1.5"], "--warmup-share 1.5: allowed above 0 up to 1"),
])
def test_the_engine_refuses_a_share_it_cannot_use_before_it_connects(args, said):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "loom_live.engine", "serve", "--connect", "ipc:///nonexistent/loom",
                           "--passthrough", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and said in proc.stderr


def test_the_served_engine_hands_its_share_to_the_warm_up_it_does_with_or_without_warmup(monkeypatch):
    """`--warmup-share` reaches the warm-up a GPU session does on its own (no --warmup: through open_session to
    the family's from_config) and the one --warmup asks for."""
    import argparse

    from loom_live.engine.server.main import _session_factory
    from loom_live.engine.stream.session import StreamSession

    seen = []

    class _Opened:
        def warmup(self, share: float = 1.0) -> None:
            seen.append(("warmup", share))

    def from_config(cls, cfg, warmup=True, warmup_share=1.0):
        seen.append(("from_config", warmup, warmup_share))
        return _Opened()

    monkeypatch.setattr(StreamSession, "from_config", classmethod(from_config))
    for flag in (False, True):
        build, _ = _session_factory(argparse.Namespace(config="default", overrides=[], loras=[], gpus=None,
                                                       passthrough=False, warmup=flag, warmup_share=0.3))
        build()
    assert seen == [("from_config", True, 0.3), ("from_config", False, 0.3), ("warmup", 0.3)]
