"""`Bridge.process_stream`: a lossless stream whose outputs come back while its input is still being read."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loom_live.host_bridge import Bridge, BridgeConfig
from tests.fakes.engines import indexed_frame

ROOT = Path(__file__).resolve().parents[2]


def test_a_lossless_stream_yields_each_output_in_order_while_its_input_is_still_read():
    pulled: list[int] = []

    def frames():
        for i in range(40):
            pulled.append(i)
            yield indexed_frame(i) if i < 30 else indexed_frame(i, h=16, w=16)  # and a size change on the way

    config = BridgeConfig(passthrough=True, engine_cwd=str(ROOT), heartbeat_s=0.1, ring_slots=3)
    with Bridge(config) as bridge:
        bridge.wait_running(60)
        read_when_out: list[int] = []
        for i, out in enumerate(bridge.process_stream(frames(), stall_timeout_s=60)):
            read_when_out.append(len(pulled))
            assert np.array_equal(out, indexed_frame(i) if i < 30 else indexed_frame(i, h=16, w=16)), i
        assert len(read_when_out) == 40
        assert read_when_out[0] < 40, "the first output waited for the whole input"
        assert bridge.engine_report(refresh=True)["lossless"] is False, "the engine is back in live mode"
        assert bridge.submit(indexed_frame(99))  # and takes live frames again
