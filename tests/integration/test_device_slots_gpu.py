"""The engine's cuda-ipc slot reads and writes (engine/server/device_frames.py) on a real GPU: queued, not waited for.

Run on a CUDA machine (`pytest -m gpu tests/integration/test_device_slots_gpu.py`). The frame worker releases an
input slot right after the read returns and sends an output notice right after the write returns; the GPU orders
the rest (the host's next write into the input slot waits for the read's event, the host's read of the output for
the write's). So both must return while the GPU is still busy, and what they move must still arrive whole.
"""

from __future__ import annotations

import threading

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


def _in_thread(fn):
    """Run `fn` on a thread of its own, as the frame worker runs: the slots make their stream that thread's."""
    result, failure = [], []

    def body():
        try:
            result.append(fn())
        except BaseException as exc:  # raised again on the test's thread
            failure.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if failure:
        raise failure[0]
    return result[0]


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
        _in_thread(work)
    finally:
        ring.close()


@pytest.mark.gpu
@pytest.mark.parametrize("channels, order, orientation", LAYOUTS)
def test_an_input_read_returns_before_a_busy_gpu_does_it_and_the_next_write_waits_for_it(
        channels, order, orientation):
    import torch

    from loom_live.engine.server.device_frames import DeviceSlots

    ring = _ring("in", channels, order, orientation)
    rng = np.random.default_rng(3)
    frames = [rng.integers(0, 256, (48, 64, channels), dtype=np.uint8) for _ in range(3)]
    slots = DeviceSlots()

    def work():
        ring.write(0, frames[0])
        slots.read(ring, 0)  # loads the conversion's kernels: not timed
        torch.cuda.synchronize()
        ring.write(1, frames[1])
        torch.cuda._sleep(BUSY_CYCLES)  # on the worker's stream, where the read is queued next
        got = slots.read(ring, 1)
        assert _not_done(ring._read_events[1]), "the read waited for the GPU"
        ring.write(1, frames[2])  # the host's next frame into the same slot: after the read, on the GPU
        return got.cpu().numpy()

    try:
        got = _in_thread(work)
        assert np.array_equal(got, formats.to_engine(frames[1], order=order, bottom_up=orientation == "bottom-up"))
    finally:
        ring.close()
