"""The edit family behind the same server and bridge as the Wan family (engine/session_api.open_session)."""

from __future__ import annotations

import numpy as np
import pytest

from loom_live.engine.config import load_config
from loom_live.engine.session_api import open_session
from loom_live.host_bridge import Bridge, BridgeConfig
from tests.fakes.engines import InProcessEngine


@pytest.fixture
def bridge():
    cfg = load_config("edit-tiny", ["resolution.width=32", "resolution.height=32", "edit.batch=3"])
    with InProcessEngine(lambda: open_session(cfg)) as engine:
        b = Bridge(BridgeConfig(**engine.host, heartbeat_s=0.1, hang_timeout_s=2.0)).start()
        try:
            b.wait_running(30)
            yield b
        finally:
            b.close()


def test_edit_family_serves_every_frame_with_its_own_parameters(bridge):
    frames = [np.random.default_rng(i).integers(0, 256, (40, 56, 3), np.uint8) for i in range(7)]
    outs = bridge.process(frames, timeout_s=60)  # two batches of 3 and a padded tail of 1
    assert len(outs) == 7 and all(o.shape == (40, 56, 3) for o in outs)
    bridge.set_params(wait=True, adapter_strength=0.5, prompt_refresh_every=4)
    with pytest.raises(ValueError, match="unknown parameter"):
        bridge.set_params(wait=True, noise_scale=0.5)  # a Wan parameter: refused by name
