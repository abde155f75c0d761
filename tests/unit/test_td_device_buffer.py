"""The TouchDesigner operator's device buffer keeps its CUDA stream alive across size changes.

Every device call of a cook goes on the buffer's stream; TouchDesigner and the bridge hold its handle
for the cook. Freeing the stream when the buffer is first allocated (or resized) left a dangling
handle that the next `cudaStreamWaitEvent` dereferenced: a segfault of TouchDesigner on a GPU.
The CPU stand-in of the runtime refuses any use of a destroyed stream.
"""

from __future__ import annotations

import pytest

pytest.importorskip("cuda.bindings.runtime", reason="the cuda-ipc code needs cuda-python (no GPU)")


def test_the_stream_outlives_allocation_and_resizes_and_dies_with_close(monkeypatch):
    from loom_live.host_bridge.wire.rings import cuda as tc
    from loom_live.plugin.touchdesigner.loom_ext import DeviceBuffer
    from tests.fakes.cuda_runtime import FakeRuntime

    rt = FakeRuntime()
    monkeypatch.setattr(tc, "cudart", rt)
    buf = DeviceBuffer()
    stream = buf.stream
    first = buf.ensure(64)
    assert buf.ensure(64) == first  # same size: same buffer
    buf.ensure(128)  # a new size: a new buffer, the old one freed
    assert rt.freed == 1
    assert stream in rt.streams  # still the stream TouchDesigner's calls were given
    rt.cudaStreamWaitEvent(tc.cudart.cudaStream_t(stream), 1, 0)  # what the next cook does: no crash
    buf.close()
    assert stream in rt.destroyed_streams and rt.freed == 2


def test_a_ring_read_on_the_hosts_stream_after_the_buffer_is_sized(monkeypatch):
    """The order of a cuda-ipc cook: size the output buffer, then read the staging ring on the stream."""
    import numpy as np

    from loom_live.host_bridge.wire.rings import cuda as tc
    from loom_live.host_bridge.wire.rings.cuda import CudaRing
    from loom_live.plugin.touchdesigner.loom_ext import DeviceBuffer
    from tests.fakes.cuda_runtime import FakeRuntime

    rt = FakeRuntime()
    monkeypatch.setattr(tc, "cudart", rt)
    buf = DeviceBuffer()
    ring = CudaRing.create(device=0, transport="cuda-ipc", dir="in", slots=1, generation=0, width=4, height=2,
                           channels=4, dtype="uint8", order="BGRA", orientation="bottom-up")
    frame = np.arange(32, dtype=np.uint8).reshape(2, 4, 4)
    ring.write(0, frame)
    ptr = buf.ensure(frame.nbytes)
    ring.read_device(0, ptr, 16, stream=buf.stream)
    out = np.ctypeslib.as_array((tc.ctypes.c_uint8 * frame.nbytes).from_address(ptr)).reshape(frame.shape)
    assert np.array_equal(out, frame)
    ring.close()
    buf.close()
