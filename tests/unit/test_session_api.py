"""Every session the server or bench drives implements the declared `EngineSession` interface:
the server never probes a session, so a missing member or a changed signature must fail here."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from loom_live.engine.config import load_config
from loom_live.engine.edit.session import EditSession
from loom_live.engine.parallel.session import PipelineSession
from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.engine.session_api import EngineSession
from loom_live.engine.stream.session import StreamSession

SESSIONS = [PassthroughSession, StreamSession, PipelineSession, EditSession]
METHODS = [name for name, member in vars(EngineSession).items()
           if inspect.isfunction(member) and not name.startswith("_")]
PROPERTIES = [name for name, member in vars(EngineSession).items() if isinstance(member, property)]


def test_the_interface_names_what_the_server_uses():
    assert set(METHODS) == {"push", "poll", "flush", "while_waiting", "set_prompt", "set_params", "set_reference",
                            "reset", "stats", "close"}
    assert set(PROPERTIES) == {"accepts_device_frames", "raw_passthrough", "unfinished"}


@pytest.mark.parametrize("cls", SESSIONS, ids=lambda c: c.__name__)
def test_session_class_has_every_member_with_a_compatible_signature(cls):
    for name in PROPERTIES:
        member = inspect.getattr_static(cls, name, None)
        assert member is not None, f"{cls.__name__}.{name} is missing"
        assert not callable(member), f"{cls.__name__}.{name} must be a property or a value, not a method"
    for name in METHODS:
        impl = inspect.getattr_static(cls, name, None)
        assert inspect.isfunction(impl), f"{cls.__name__}.{name} is missing"
        want = inspect.signature(getattr(EngineSession, name)).parameters
        have = inspect.signature(impl).parameters
        for pname, param in want.items():
            assert pname in have, f"{cls.__name__}.{name} lacks parameter {pname!r}"
            assert have[pname].kind == param.kind, f"{cls.__name__}.{name}({pname}): {have[pname].kind}"
            assert have[pname].default == param.default, f"{cls.__name__}.{name}({pname}) default"
        extra = [p for n, p in have.items() if n not in want and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        assert all(p.default is not p.empty for p in extra), f"{cls.__name__}.{name}: extra required parameters"


def test_passthrough_session_is_an_engine_session():
    session = PassthroughSession()
    assert isinstance(session, EngineSession)
    assert session.raw_passthrough and not session.accepts_device_frames and session.unfinished == 0
    frames = np.zeros((2, 4, 4, 3), np.uint8)
    assert np.array_equal(session.push(frames), frames)
    assert len(session.poll()) == 0 and len(session.flush()) == 0
    session.close()


def test_stream_session_is_an_engine_session():
    cfg = load_config("tiny-random", ["resolution.width=32", "resolution.height=32"])
    with StreamSession.from_config(cfg, warmup=False) as session:
        assert isinstance(session, EngineSession)
        assert session.raw_passthrough is False and session.unfinished == 0


def test_the_wan_session_refuses_another_familys_parameters_by_name():
    from loom_live.engine.config import load_config
    from loom_live.engine.stream.session import StreamSession

    with StreamSession.from_config(load_config("default"), warmup=False) as session:
        with pytest.raises(ValueError, match="unknown parameter 'adapter_strength'; settable: steps"):
            session.set_params(adapter_strength=0.5)


def test_a_stream_session_refuses_a_config_of_another_family_before_it_loads(monkeypatch):
    """StreamSession.from_config on an edit preset loaded the Wan defaults and ran them: not the model named."""
    import loom_live.engine.stream.session as stream_session

    monkeypatch.setattr(stream_session, "load_models", lambda cfg: pytest.fail("loaded"))
    with pytest.raises(ValueError, match=r"^model.family: 'edit'; a StreamSession runs the Wan family .*open_session"):
        StreamSession.from_config(load_config("edit-tiny"), warmup=False)
    with pytest.raises(ValueError, match=r"^parallel.gpus: 2; a StreamSession runs on one GPU .*open_session"):
        StreamSession.from_config(load_config("tiny-random", ["parallel.gpus=2"]), warmup=False)


def test_the_gpus_a_run_needs_are_checked_before_anything_loads(monkeypatch):
    """A GPU index past the visible ones failed deep in the model load (torch's "invalid device ordinal");
    it is named with what is allowed, as a pipeline that needs more GPUs than are here is."""
    import torch

    from loom_live.engine.session_api import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_devices(load_config("tiny-random", ["model.device=cuda:1"]))  # there: nothing to say
    with pytest.raises(ValueError, match=r"^model.device: 'cuda:2' names a GPU that is not here \(2 visible\); "
                                         r"allowed: auto, cpu, cuda or cuda:0\.\.cuda:1$"):
        check_devices(load_config("tiny-random", ["model.device=cuda:2"]))
    with pytest.raises(ValueError, match=r"^parallel.gpus: 2 GPUs from cuda:1 on need GPU 2, but only 2 are "
                                         r"visible; allowed: at most 1$"):
        check_devices(load_config("tiny-random", ["model.device=cuda:1", "parallel.gpus=2"]))
