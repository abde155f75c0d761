"""A steady stream on a GPU never makes the host wait for the GPU inside a push (engine/stream/session.py).

Run on a CUDA machine (`pytest -m gpu tests/integration/test_stream_host_waits_gpu.py`). Why it matters: the
engine's frame worker sends paced outputs only between session calls or in a call's looks at the GPU
(`while_waiting`); a hidden host wait inside a push (a copy from pageable host memory, an `.item()`, a
synchronize) holds the worker there for up to the GPU's queued work, so outputs leave late and in bunches, and
the CPU cannot queue the next chunk ahead of the GPU. Torch's sync debug mode names each such call; the test
lists where they come from, by file and line.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from loom_live.engine.config import load_config  # noqa: E402

WARM_FRAMES = 29  # the first chunk (5 frames, eager) and six more: compiled, captured, shapes settled
STEADY_FRAMES = 40


@pytest.mark.gpu
@pytest.mark.parametrize("steps", ["[700]", "[700, 500]"])
def test_a_steady_stream_never_waits_for_the_gpu_inside_a_push(steps):
    """Device frames (what a cuda-ipc host's frames become), then host arrays (the player's and shm's), each in a
    stream of its own on one session (built and compiled once)."""
    from loom_live.engine.stream.session import StreamSession

    # RoPE refresh every 8 latent frames: the steady frames cross it more than once
    session = StreamSession.from_config(load_config("tiny-random", [f"stream.steps={steps}",
                                                                    "stream.rope_refresh_at=8"]))
    session.while_waiting(lambda: None)  # its waits become looks at events, as under the engine server
    frames = torch.randint(0, 256, (WARM_FRAMES + STEADY_FRAMES, 128, 128, 3), dtype=torch.uint8, device="cuda")
    sites = {}
    try:
        for kind, given in (("device frames", frames), ("host arrays", frames.cpu().numpy())):
            session.reset()
            for i in range(WARM_FRAMES):
                session.push(given[i:i + 1])
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    outputs = sum(len(session.push(given[i:i + 1])) for i in range(WARM_FRAMES, len(given)))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            sites[kind] = sorted({f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
            assert outputs >= STEADY_FRAMES - 8, kind  # the stream went on (at most two chunks still on the GPU)
    finally:
        session.close()
    assert not any(sites.values()), f"pushes made the host wait for the GPU at: {sites}"
