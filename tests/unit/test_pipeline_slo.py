"""The SLO scheduler over pipeline ranks: plans priced from the ranks' stage windows."""

from __future__ import annotations

import pytest

from loom_live.engine.parallel.slo import PipelineSLO
from loom_live.engine.stream.slo_scheduler import PATIENCE, PRIOR_FIXED_FRACTION, Plan

# 4 ticks of 2 rows (2 steps) of 1-latent chunks: 4 chunks in, 4 out, 4 messages of 2 rows
WORK = {"in": (4, 4), "out": (4, 4), "rows": (8, 4)}
# per tick: rank 0 encodes 10 ms, runs its blocks 20 ms, postprocesses 1 ms (31 ms);
# rank 1 runs its blocks 30 ms and the head 5 ms, decodes 15 ms (50 ms: the slowest)
WINDOWS = [{"rank": 0, "ticks": 4, "seconds": {"encode": 0.040, "dit": 0.080, "postprocess": 0.004}},
           {"rank": 1, "ticks": 4, "seconds": {"dit": 0.120, "head": 0.020, "decode": 0.060}}]


def scheduler(**kwargs) -> PipelineSLO:
    slo = PipelineSLO(2, 2, max_chunk_latents=1, **kwargs)
    slo.observe_windows(WINDOWS, WORK)
    return slo


def test_batch_runs_at_the_slowest_rank_and_a_chunk_goes_round_the_ring_n_times():
    fps, latency = scheduler().predict(Plan("batch", 1))
    assert fps == pytest.approx(4 / 0.050)
    assert latency == pytest.approx(2 * 2 * 0.050)  # n passes of P ranks, one period each


def test_sequential_adds_every_rank_over_the_n_passes():
    one_row = PRIOR_FIXED_FRACTION + (1 - PRIOR_FIXED_FRACTION) / 2  # 1 row where 2 were measured
    through = (0.010 + 0.001 + 2 * 0.020 * one_row) + (0.015 + 2 * 0.035 * one_row)
    fps, latency = scheduler().predict(Plan("sequential", 1))
    assert latency == pytest.approx(through) and fps == pytest.approx(4 / through)


def test_input_rate_adds_the_wait_for_a_chunk():
    slo = scheduler()
    slo.observe_input_rate(40.0)
    assert slo.predict(Plan("batch", 1))[1] == pytest.approx(4 / 40 + 0.2)


def test_a_missed_budget_switches_to_sequential_after_the_patience():
    slo = PipelineSLO(2, 2, latency_budget_s=0.15, max_chunk_latents=1)
    assert slo.decide() == Plan("batch", 1)  # nothing measured: the plan stays
    slo.observe_windows(WINDOWS, WORK)
    for _ in range(PATIENCE - 1):
        assert slo.decide() == Plan("batch", 1)
    assert slo.decide() == Plan("sequential", 1)
    slo.reset()
    assert slo.plan == Plan("batch", 1) and slo.decide() == Plan("batch", 1)


def test_a_pinned_mode_is_kept_and_a_budget_met_never_churns():
    pinned = scheduler(latency_budget_s=0.15, allowed_modes=("batch",))
    assert all(pinned.decide() == Plan("batch", 1) for _ in range(2 * PATIENCE))
    relaxed = scheduler(latency_budget_s=1.0)
    assert all(relaxed.decide() == Plan("batch", 1) for _ in range(2 * PATIENCE))


def test_a_part_that_did_not_run_learns_nothing():
    slo = PipelineSLO(2, 2)
    slo.observe_windows(WINDOWS, {"rows": (8, 4)})  # no chunk entered or left in the window
    assert set(slo.stages) == {"0:rows", "1:rows"}
