"""The warm-up meets, in a few chunks, everything a long live stream meets (forward shapes, the CUDA
graph of each steady forward, the RoPE refresh, the VAE steps), and leaves no state behind.

On the CPU no graph is captured, so `Evidence` replays `GraphedStreamForward`'s rule on the host: the
same plan and key, a key seen first runs eagerly, the second time it is captured, later replayed. A
live stream after the warm-up must replay only: any capture or first sight would stall a show's chunk.
"""

from __future__ import annotations

import math
from collections import Counter

import cv2
import numpy as np
import pytest
import torch

from loom_live.engine.cache.kv_cache import EAGER_CACHE_OPS, KVCache
from loom_live.engine.config import load_config
from loom_live.engine.graphs.dit_steps import MAX_GRAPHS, _key
from loom_live.engine.models.loading import load_models
from loom_live.engine.stream.session import StreamSession
from loom_live.engine.stream.slo_scheduler import Plan
from tests.fakes.tiny_vace import clip, tiny_vace_models
from tests.fakes.tiny_vace import session as vace_session

SMALL = ["resolution.width=16", "resolution.height=16"]  # tiny-random keeps its 6-slot window and refresh at 50


class Evidence:
    """What a session's streams meet, by phase ("warm", then "live"): per forward its shape and whether
    attention was masked, the graph key of each graphed forward and its route, the forwards a RoPE refresh
    happened in, and every VAE step (direction, stream started, shape)."""

    def __init__(self, session: StreamSession, monkeypatch: pytest.MonkeyPatch) -> None:
        self.phase = "warm"
        self.met: dict[str, set] = {"warm": set(), "live": set()}
        self.routes: dict[str, Counter] = {"warm": Counter(), "live": Counter()}
        self.refreshes: dict[str, int] = {"warm": 0, "live": 0}
        self._seen: set = set()
        self._captured: set = set()
        self._step = None
        self._shifts = 0
        plan, shift = KVCache.plan, KVCache._shift_ring

        def planning(cache, *args, **kwargs):
            self._step = plan(cache, *args, **kwargs)
            return self._step

        def shifting(cache, b, frames):
            self._shifts += 1
            return shift(cache, b, frames)

        monkeypatch.setattr(KVCache, "plan", planning)
        monkeypatch.setattr(KVCache, "_shift_ring", shifting)
        dit = session.models.dit
        rows = dit.forward_stream  # partial forwards (pipeline fill and drain): eager

        def eager(x, t, cache, cross, commit=True, **inputs):
            out = rows(x, t, cache, cross, commit, **inputs)
            self._note(x, "rows", None)
            return out

        monkeypatch.setattr(dit, "forward_stream", eager)
        session.denoiser.graphed_forward = self._graphed(dit)
        for part, name, state in ((session.models.encoder, "encode_stream", "encoder"),
                                  (session.models.decoder, "decode_stream", "decoder")):
            monkeypatch.setattr(part, name, self._vae(getattr(part, name), name, state))

    def _graphed(self, dit):
        def forward(x, t, cache, cross, commit=True, **inputs):
            step = cache.plan(x.shape[2], commit)
            key = _key(x, t, cache, step, inputs)
            if key is None:
                route = "masked"
            elif key in self._captured:
                route = "replay"
            elif key in self._seen and len(self._captured) < MAX_GRAPHS:
                route = "capture"
                self._captured.add(key)
            else:
                route = "first"
            self._seen.add(key)
            out = dit.stream_step(x, t, cache, cross, step, **inputs)
            cache.finish(step)
            self._note(x, route, key)
            return out

        return forward

    def _vae(self, inner, name: str, state_name: str):
        def call(x, state):
            self.met[self.phase].add(("vae", name, getattr(state, state_name).started, tuple(x.shape)))
            return inner(x, state)

        return call

    def _note(self, x: torch.Tensor, route: str, key: tuple | None) -> None:
        met = self.met[self.phase]
        met.add(("shape", tuple(x.shape), self._step.mask is None))
        if key is not None:
            met.add(("graph", key))
        if self._shifts:  # the refresh's own code is the same in every route; a graph's own key is noted above
            met.add(("refresh", tuple(x.shape)))
            self.refreshes[self.phase] += self._shifts
            self._shifts = 0
        self.routes[self.phase][route] += 1


def warm_up_chunks(session: StreamSession, streams: int = 2) -> int:
    """The chunks `warmup()` streams, from the config: per plan of k latents, the first chunk and
    ceil(num_kv_cache / k) filling the window, then, for each of the g = gcd(ring, k) ring phases the
    pipeline fill (n - 1 in batch mode) and the ring / g slot patterns twice, g - 1 one-latent chunks
    between phases, and a last chunk. The first plan streams again, at most 8 chunks. Nothing depends on
    rope_refresh_at: the refresh is brought forward."""
    st = session.cfg.stream
    n, ring = len(st.steps), st.num_kv_cache - st.sink

    def one(plan: Plan) -> int:
        k = plan.chunk_latents
        fill = -(-st.num_kv_cache // k)
        g = math.gcd(ring, k)
        return 1 + fill + g * ((n - 1 if plan.mode == "batch" else 0) + 2 * ring // g) + (g - 1) + 1

    plans = session.warmup_plans()
    return one(plans[0]) + (streams - 1) * min(one(plans[0]), 8) + sum(one(p) for p in plans[1:])


def live_stream(session: StreamSession, latents: int, seed: int) -> list[np.ndarray]:
    """A stream the scheduler moves through every plan at random, each held for 1 to 5 chunks, so it
    enters the plans at every ring phase; flushed. Returns the outputs of each push."""
    rng = np.random.default_rng(seed)
    session.slo.decide = lambda: session.slo.plan
    frames = lambda n: rng.integers(0, 256, (n, 16, 16, 3), np.uint8)  # noqa: E731
    outs = [session.push(frames(5))]
    done = 2
    while done < latents:
        plan = session.slo.candidates[rng.integers(len(session.slo.candidates))]
        session.slo.hold(plan)
        for _ in range(rng.integers(1, 6)):
            outs.append(session.push(frames(4 * plan.chunk_latents)))
            done += plan.chunk_latents
    outs.append(session.flush())
    return outs


@pytest.mark.parametrize("steps", ["[700]", "[700,500]"])
def test_the_warm_up_meets_everything_a_long_stream_meets(steps, monkeypatch):
    session = StreamSession(*_config_and_models([f"stream.steps={steps}"]))
    evidence = Evidence(session, monkeypatch)
    chunks = Counter()
    denoise = session._denoise
    monkeypatch.setattr(session, "_denoise", lambda c: (chunks.update([evidence.phase]), denoise(c))[1])
    session.warmup()
    n = len(session.cfg.stream.steps)
    assert chunks["warm"] == warm_up_chunks(session)
    assert evidence.refreshes["warm"] >= n * len(session.warmed_plans)  # every plan's stream refreshed every row
    evidence.phase = "live"
    live_stream(session, latents=160, seed=3)
    assert evidence.refreshes["live"] >= 2 * n  # past two refreshes of every cache row
    live, warm = evidence.met["live"], evidence.met["warm"]
    assert live <= warm, f"first met mid-show: {sorted(live - warm, key=repr)}"
    assert {kind for kind, *_ in live} == {"shape", "graph", "refresh", "vae"}
    # 3-latent chunks entered at several ring phases (3 slots), each its own graph; all captured by the
    # warm-up, none mid-show
    assert len({e for e in live if e[0] == "graph" and e[1][0][2] == 3}) >= 2
    assert evidence.routes["live"]["replay"] > 0
    assert evidence.routes["live"]["first"] == evidence.routes["live"]["capture"] == 0


def test_a_stream_after_the_warm_up_equals_one_without_it():
    """The warm-up leaves no state behind: after it a stream (plan changes, a RoPE refresh) is bit for
    bit the stream of a session that never warmed up."""
    cfg, models = _config_and_models([])
    warmed, fresh = StreamSession(cfg, models), StreamSession(cfg, models)
    warmed.warmup()
    assert warmed.denoiser.cache.next_positions == fresh.denoiser.cache.next_positions
    a, b = live_stream(warmed, latents=70, seed=11), live_stream(fresh, latents=70, seed=11)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    assert sum(len(x) for x in a) > 200  # frames came out


def test_a_vace_warm_up_reaches_the_grey_fixed_point_and_refreshes_after_the_reference(tmp_path, monkeypatch):
    """VACE: the short warm-up (one plan: about 15 latents) still settles the grey part's latents (the
    tiny VAE's fixed point is at latent 20), so a show encodes none; its refresh counts from after the
    reference entry, which a stream commits first."""
    ref = tmp_path / "ref.png"
    cv2.imwrite(str(ref), np.full((64, 64, 3), 128, np.uint8))
    session = vace_session(tiny_vace_models(), "stream.mode=batch", f"control.reference={ref}", *SMALL)
    evidence = Evidence(session, monkeypatch)
    session.warmup()
    grey = session.control.encoder.inactive
    assert grey.steady_from is not None and evidence.refreshes["warm"] >= 1
    encodes = grey.encodes
    outs = [session.push(clip(5))] + [session.push(clip(4)) for _ in range(30)]
    assert sum(len(o) for o in outs) == 125 and grey.encodes == encodes


def _config_and_models(overrides: list[str]):
    cfg = load_config("tiny-random", [*SMALL, *overrides])
    return cfg, load_models(cfg)


# ----- KVCache.refresh_after --------------------------------------------------------------------
def _cache(policy: str = "refresh") -> KVCache:
    return KVCache.allocate(1, (1, 2), 1, 12, [0], num_kv_cache=6, sink=3, rope_policy=policy, refresh_at=50,
                            sink_threshold=-1.0, dtype=torch.float32)


def _push(cache: KVCache, frames: int) -> None:
    step = cache.plan(frames)
    k = torch.randn(1, frames * 2, 1, 12)
    cache.attend(step, EAGER_CACHE_OPS, 0, k, k, k)
    cache.finish(step)


def _refresh_chunk(cache: KVCache, chunks: int) -> int | None:
    """The index of the first chunk (2 frames, then 1 each) after which the positions fell back."""
    for i in range(chunks):
        before = cache.next_positions[0]
        _push(cache, 2 if i == 0 else 1)
        if cache.next_positions[0] < before:
            return i
    return None


def test_refresh_after_brings_the_refresh_to_the_chunk_asked_and_reset_undoes_it():
    cache = _cache()
    assert _refresh_chunk(cache, 60) == 49  # a live stream: the frame at position 50
    long_run = (cache.positions, cache.next_positions)
    cache.reset()
    cache.refresh_after(10)  # the frame 10 frames from now: chunk 9 (the first chunk holds 2)
    assert _refresh_chunk(cache, 60) == 9
    assert cache.next_positions == long_run[1]  # after the refresh, positions as a long stream's
    assert sorted(p for p in cache.positions[0] if p is not None) == sorted(long_run[0][0])
    cache.reset()
    assert cache.next_positions == [0] and _refresh_chunk(cache, 60) == 49


def test_refresh_after_only_before_the_ring_and_past_the_window():
    cache = _cache()
    with pytest.raises(ValueError, match="window"):
        cache.refresh_after(5)  # the window (6 frames) is not full by then: no live refresh comes there
    for _ in range(4):
        _push(cache, 1)
    with pytest.raises(ValueError, match="holds 4 frames"):
        cache.refresh_after(20)  # a ring frame is in: its stored rotation would no longer match
    window = _cache("window")
    window.refresh_after(10)  # no refresh under the window policy: nothing to move
    assert window.next_positions == [0]
