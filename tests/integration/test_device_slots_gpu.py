"""The engine's cuda-ipc output writes (engine/server/device_frames.py) on a real GPU: queued, not waited for.

Run on a CUDA machine (`pytest -m gpu tests/integration/test_device_slots_gpu.py`). The frame worker sends an
output notice right after the write returns; the host's read waits for the slot's event on the GPU. So the write
must return while the GPU is still busy, and a reader that honours the event must still see the frame whole.
"""

from __future__ import annotations

import numpy as np
import pytest

from loom_live.host_bridge.wire import pixels as formats

BUSY_CYCLES = 500_000_000  # a spin kernel of this many GPU clock cycles (a few hundred milliseconds)
LAYOUTS = [(4, "BGRA", "bottom-up"), (3, "RGB", "top-down")]


@pytest.fixture(autouse=True)
def _cuda_ipc_available():
    from loom_live.host_bridge.wire.rings.cuda import cuda_available

    ok, why = cuda_available()
    if not ok:
        pytest.skip(f"cuda-ipc unavailable: {why} (install cuda-python matching the driver)")


def _ring(direction: str, channels: int, order: str, orientation: str, h: int = 48, w: int = 64):
    from loom_live.host_bridge.wire.rings.cuda import CudaRing

    return CudaRing.create(dir=direction, transport="cuda-ipc", slots=3, width=w, height=h, channels=channels,
                           dtype="uint8", generation=0, order=order, orientation=orientation)


def _not_done(event) -> bool:
    from loom_live.host_bridge.wire.rings.cuda import cudart

    return cudart.cudaEventQuery(event)[0] == cudart.cudaError_t.cudaErrorNotReady


@pytest.mark.gpu
@pytest.mark.parametrize("channels, order, orientation", LAYOUTS)
def test_an_output_write_returns_before_a_busy_gpu_does_it_and_the_reader_sees_the_frame(
        channels, order, orientation):
    import torch

    from loom_live.engine.server.device_frames import DeviceSlots

    ring = _ring("out", channels, order, orientation)
    slots = DeviceSlots()

    def work():
        first = torch.zeros((48, 64, 3), dtype=torch.uint8, device="cuda")
        slots.write(ring, 0, first)  # the first write loads the conversion's kernels (that may wait): not timed
        torch.cuda.synchronize()
        for slot in (1, 2):
            frame = torch.randint(0, 256, (48, 64, 3), dtype=torch.uint8, device="cuda")
            expected = frame.cpu().numpy()
            torch.cuda._sleep(BUSY_CYCLES)  # the GPU is busy on the stream the frame was made on
            slots.write(ring, slot, frame)
            del frame  # the worker drops its reference at once: the memory must live until the copy is done
            assert _not_done(ring.events[slot]), "the write waited for the GPU"
            got = ring.read(slot, [])  # waits for the slot's event, as a host's read does
            assert np.array_equal(formats.to_engine(got, order=order, bottom_up=orientation == "bottom-up"), expected)
            if channels == 4:
                assert (got[:, :, 3] == 255).all()

    try:
        work()
    finally:
        ring.close()
