"""The engine's cuda-ipc output writes (engine/server/device_frames.py) on a real GPU: queued, not waited for.

Run on a CUDA machine (`pytest -m gpu tests/integration/test_device_slots_gpu.py`). The frame worker sends an
output notice right after the write returns; the host's read waits for the slot's event on the GPU. So the
write must return while the GPU is still busy, and a reader that honours the event must still see the frame.
"""

from __future__ import annotations

import numpy as np
import pytest

from loom_live.host_bridge.wire import pixels as formats

BUSY_CYCLES = 500_000_000  # a spin kernel of this many GPU clock cycles (a few hundred milliseconds)


@pytest.fixture(autouse=True)
def _cuda_ipc_available():
    from loom_live.host_bridge.wire.rings.cuda import cuda_available

    ok, why = cuda_available()
    if not ok:
        pytest.skip(f"cuda-ipc unavailable: {why} (install cuda-python matching the driver)")


@pytest.mark.gpu
@pytest.mark.parametrize("channels, order, orientation", [(4, "BGRA", "bottom-up"), (3, "RGB", "top-down")])
def test_an_output_write_returns_before_a_busy_gpu_does_it_and_the_reader_sees_the_frame(
        channels, order, orientation):
    import torch

    from loom_live.engine.server.device_frames import DeviceSlots
    from loom_live.host_bridge.wire.rings.cuda import CudaRing, cudart

    h, w = 48, 64
    ring = CudaRing.create(dir="out", transport="cuda-ipc", slots=2, width=w, height=h, channels=channels,
                           dtype="uint8", generation=0, order=order, orientation=orientation)
    slots = DeviceSlots()
    try:
        for slot in range(2):
            frame = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, device="cuda")
            expected = frame.cpu().numpy()
            torch.cuda._sleep(BUSY_CYCLES)  # the GPU is busy on the caller's stream, the frame's own
            slots.write(ring, slot, frame)
            del frame  # the worker drops its reference at once: the memory must live until the copy is done
            assert cudart.cudaEventQuery(ring.events[slot])[0] == cudart.cudaError_t.cudaErrorNotReady, \
                "the write waited for the GPU"
            got = ring.read(slot, [])  # waits for the slot's event, as a host's read does
            engine = formats.to_engine(got, order=order, bottom_up=orientation == "bottom-up")
            assert np.array_equal(engine, expected)
            if channels == 4:
                assert (got[:, :, 3] == 255).all()
    finally:
        ring.close()
