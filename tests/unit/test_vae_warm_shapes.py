"""The VAE sees no shape mid-show that the warm-up did not run.

On CUDA, cuDNN's benchmark mode picks each convolution's algorithm the first time it sees a shape
(and the compiled VAE compiles per shape), which stalls that chunk. The session sets benchmark
mode at load and warms up on its fixed streaming shapes; this checks, on the CPU, that every VAE
call of a later stream, whatever chunk size the scheduler picks, has a shape the warm-up ran.
"""

from __future__ import annotations

import numpy as np

from loom_live.engine.config import load_config
from loom_live.engine.stream.session import StreamSession
from loom_live.engine.stream.slo_scheduler import Plan

SMALL = ["resolution.width=32", "resolution.height=32", "stream.steps=[700]", "stream.cuda_graphs=false"]


def _record(session: StreamSession, sink: dict) -> None:
    """Wrap the session's VAE stream calls to note (direction, stream started, input shape, dtype)
    in the set `sink["into"]`."""
    for name, part, cache in (("encode_stream", session.models.encoder, "encoder"),
                              ("decode_stream", session.models.decoder, "decoder")):
        inner = getattr(part, name)

        def call(x, state, _inner=inner, _name=name, _cache=cache):
            sink["into"].add((_name, getattr(state, _cache).started, tuple(x.shape), x.dtype))
            return _inner(x, state)

        setattr(part, name, call)


def test_a_stream_after_the_warm_up_brings_no_new_vae_shape():
    session = StreamSession.from_config(load_config("tiny-random", SMALL), warmup=False)
    warm, later = set(), set()
    sink = {"into": warm}
    _record(session, sink)
    session.warmup(streams=2, chunks=3)
    assert {name for name, *_ in warm} == {"encode_stream", "decode_stream"}
    sink["into"] = later
    rng = np.random.default_rng(7)
    session.push(rng.integers(0, 256, (5, 32, 32, 3), np.uint8))
    for size in (3, 1, 2):  # plans the scheduler may pick mid-show: several latents per chunk
        session.slo.plan = Plan(session.slo.modes[0], size)
        session.push(rng.integers(0, 256, (4 * size, 32, 32, 3), np.uint8))
    session.flush()
    assert later and later <= warm, f"shapes first seen mid-show: {sorted(later - warm)}"


def test_a_stream_starts_with_its_first_frame_alone():
    """The first chunk's first frame (encode) and first latent (decode) go alone, before the steady
    pieces: the only calls on a fresh stream history, which the compiled VAE runs uncompiled."""
    session = StreamSession.from_config(load_config("tiny-random", SMALL), warmup=False)
    calls: set = set()
    _record(session, {"into": calls})
    session.push(np.random.default_rng(3).integers(0, 256, (9, 32, 32, 3), np.uint8))
    session.flush()
    first = {(name, shape[2]) for name, started, shape, _ in calls if not started}
    assert first == {("encode_stream", 1), ("decode_stream", 1)}
    assert {shape[2] for name, started, shape, _ in calls if started and name == "encode_stream"} == {4}
