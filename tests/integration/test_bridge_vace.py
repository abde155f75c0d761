"""VACE input over the bridge, through a real engine server and its pass-through session (which records
what arrives): control frames beside the input frames in the same slot (shm with the doorbell, tcp with
payloads), refused and counted when they do not fit while the frames go on, missing ones counted; a
reference image sent live, cleared, and told again to a fresh engine."""

from __future__ import annotations

import numpy as np
import pytest

from loom_live.engine.server.passthrough import PassthroughSession
from loom_live.host_bridge import Bridge, BridgeConfig
from loom_live.host_bridge.config import MAX_HANG_TIMEOUT_S
from loom_live.host_bridge.wire import pixels as formats
from tests.fakes.engines import InProcessEngine, indexed_frame

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
# Nothing here tests hang detection: an engine thread that a loaded machine keeps off the GIL past the
# hang timeout counts as hung and is reconnected, its counts reset, mid-test; so the longest one allowed.
QUIET = dict(heartbeat_s=0.1, hang_timeout_s=MAX_HANG_TIMEOUT_S)


def session_report(bridge: Bridge) -> dict:
    """What the pass-through session recorded, now: a request it answers refreshes its stats in order
    with the frames before it (its stats between frames are refreshed at most four times a second)."""
    bridge.set_params(noise_scale=0.5, wait=True)
    return bridge.engine_report(refresh=True)["session"]["control"]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_control_frames_travel_beside_the_frames_and_bad_ones_are_refused(transport):
    frames = [indexed_frame(i) for i in range(6)]
    controls = [255 - f for f in frames]
    with InProcessEngine(PassthroughSession) as engine:
        with Bridge(BridgeConfig(transport=transport, **engine.host, **QUIET)) as bridge:
            bridge.wait_running(20)
            outs = bridge.process(frames, timeout_s=30, control=controls)
            assert all(np.array_equal(o, f) for o, f in zip(outs, frames))  # the frames as they were
            report = session_report(bridge)
            assert report["frames"] == 6 and report["sum"] == sum(int(c.astype(np.int64).sum()) for c in controls)
            # live: a control frame of another size is refused, said and counted; its frame goes on (missing one)
            bridge.submit(frames[0], control=np.zeros((8, 8, 3), np.uint8))
            assert bridge.wait_for_output(bridge.last_seq, 10)
            bridge.submit(frames[1])  # a host that gives control frames gave none for this one
            assert bridge.wait_for_output(bridge.last_seq, 10)
            stats = bridge.stats()
            assert stats["refused_control"] == 1, stats
            assert "control frame refused: control frame 8x8" in stats["last_error"], stats
            nan = np.full(frames[2].shape, np.nan, np.float32)  # values the conversion reads once, naming it
            bridge.submit(frames[2], control=nan)
            assert bridge.wait_for_output(bridge.last_seq, 10)
            stats = bridge.stats()
            assert stats["refused_control"] == 2, stats
            assert "control frame refused: control frame: holds NaN" in stats["last_error"], stats
            report = session_report(bridge)
            assert report["frames"] == 6 and report["missing"] == 3, report
            engine_stats = bridge.stats()["engine"]
            assert engine_stats["errors"] == 0 and engine_stats["refused"] == 0, engine_stats


def test_touchdesigner_frames_and_control_frames_arrive_in_the_engines_layout():
    """A TOP's numpyArray (float RGBA, bottom-up) with its control TOP's: both reach the engine as RGB top-down."""
    rng = np.random.default_rng(3)
    top = rng.random((6, 8, 4), dtype=np.float32)
    control = rng.random((6, 8, 4), dtype=np.float32)
    with InProcessEngine(PassthroughSession) as engine:
        with Bridge(BridgeConfig(transport="shm", **engine.host, **QUIET)) as bridge:
            bridge.wait_running(20)
            out = bridge.process([top], timeout_s=30, layout="touchdesigner", control=[control])[0]
            assert np.array_equal(out, formats.from_touchdesigner(top))
            want = formats.from_touchdesigner(control)
            assert session_report(bridge)["sum"] == int(want.astype(np.int64).sum())


def test_a_reference_image_is_sent_live_cleared_and_told_to_a_fresh_engine():
    image = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3)
    with InProcessEngine(PassthroughSession) as engine:
        with Bridge(BridgeConfig(transport="shm", **engine.host, **QUIET)) as bridge:
            bridge.set_reference(image)  # before the engine runs: remembered, told when it is ready
            bridge.wait_running(20)
            bridge.process([indexed_frame(0)], timeout_s=30)
            report = session_report(bridge)
            assert report["reference"] == [5, 7, 3] and report["reference_sum"] == int(image.astype(np.int64).sum())
            bridge.set_reference(image[:, :, ::-1], wait=True)  # a new one (the same bytes in another order)
            assert session_report(bridge)["reference_sum"] == int(image.astype(np.int64).sum())
            bridge.set_reference(None, wait=True)
            assert session_report(bridge)["reference"] is None
            for bad, words in [(np.full((5, 7, 3), np.nan, np.float32), "reference image"),
                               (np.zeros((5000, 4, 3), np.uint8), "at most 4096")]:
                with pytest.raises(ValueError, match=words):
                    bridge.set_reference(bad)
            assert bridge.wanted.reference is None and bridge.wanted.reference_set
