"""The cuda-ipc code paths on a CPU, against a stand-in for cuda-python's runtime module
(tests/fakes/cuda_runtime.py: host buffers as device memory, IPC handles that carry the address).

It checks the bridge's own logic: slot pitch, copies from and to raw pointers with a caller's pitch,
events and streams passed where they belong, ring descriptions, the Bridge's device staging and output
buffers, and a full in-process engine round trip. The real
driver is exercised by tests/integration/test_bridge_cuda.py on a GPU machine.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cuda.bindings.runtime", reason="the cuda-ipc ring code needs cuda-python (no GPU)")

from loom_live.engine.server.passthrough import PassthroughSession  # noqa: E402
from loom_live.host_bridge import Bridge, BridgeConfig  # noqa: E402
from loom_live.host_bridge.wire.rings import cuda as tc  # noqa: E402
from tests.fakes.cuda_runtime import FakeRuntime  # noqa: E402
from tests.fakes.engines import InProcessEngine  # noqa: E402


@pytest.fixture
def fake(monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(tc, "cudart", rt)
    return rt


def test_ring_copies_with_pitch_and_orders_with_events(fake):
    ring = tc.CudaRing.create(transport="cuda-ipc", dir="in", slots=3, width=5, height=4, channels=4,
                              dtype="float32", generation=2, order="RGBA", orientation="bottom-up")
    spec = ring.spec
    assert spec.pitch % tc.PITCH_ALIGN == 0 and spec.pitch >= 5 * 4 * 4
    assert len(spec.handles) == len(spec.events) == 3 and spec.gpu_uuid.startswith("GPU-00010203-0405")
    peer = tc.CudaRing.attach(spec)  # "the engine"
    frame = np.random.default_rng(0).random((4, 5, 4), dtype=np.float32)
    padded = np.zeros((4, 8, 4), np.float32)  # a caller's buffer with a wider pitch (TouchDesigner, torch views)
    padded[:, :5] = frame
    ring.write_device(1, padded.ctypes.data, padded.strides[0])
    assert fake.recorded[-1] == ring.events[1]  # recorded after the copy, before anyone reads
    assert np.array_equal(peer.read(1, []), frame)
    assert fake.waited[-1] == peer.events[1]  # the reader waited on the writer's event
    out = tc.CudaRing.create(transport="cuda-ipc", dir="out", slots=3, width=5, height=4, channels=4,
                             dtype="float32", generation=2)
    peer.copy_to(1, out, 2)
    dst = np.zeros((4, 6, 4), np.float32)
    out.read_device(2, dst.ctypes.data, dst.strides[0])
    assert np.array_equal(dst[:, :5], frame) and not dst[:, 5:].any()
    for r in (peer, ring, out):
        r.close()
    assert fake.freed == 6  # the owner frees its slots; the peer only closes its mappings


def test_bridge_round_trip_through_an_engine_on_cuda_ipc(fake):
    with InProcessEngine(PassthroughSession) as engine:
        cfg = BridgeConfig(transport="cuda-ipc", **engine.host, heartbeat_s=0.1,
                           hang_timeout_s=1.0)
        with Bridge(cfg) as bridge:
            bridge.wait_running(10)
            assert bridge.stats()["lane_endpoint"].startswith("doorbell:")  # notices through shared memory
            h, w = 6, 10
            bgra = np.random.default_rng(1).integers(0, 256, (h, w, 4), dtype=np.uint8)  # TouchDesigner layout
            for _ in range(3):
                bridge.submit_cuda(bgra.ctypes.data, bgra.strides[0], w, h, 4, "uint8", layout="touchdesigner")
                assert bridge.wait_for_output(bridge.last_seq, 5), bridge.status()
            back = np.zeros_like(bgra)
            status = bridge.latest_cuda(back.ctypes.data, back.strides[0])
            assert not status.fallback and np.array_equal(back, bgra)  # slot to slot, layout preserved
            rgb, status = bridge.latest()  # numpy view: converted to engine RGB top-down
            assert np.array_equal(rgb, bgra[::-1, :, [2, 1, 0]])
            frames = [np.full((4, 8, 3), i, np.uint8) for i in range(5)]
            outs = bridge.process(frames, timeout_s=10)
            assert [int(o[0, 0, 0]) for o in outs] == list(range(5))
            assert bridge.stats()["refused"] == 0
