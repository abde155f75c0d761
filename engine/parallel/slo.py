"""The SLO scheduler over a pipeline of ranks: the one-GPU plans, priced by the ring's stage times.

The plans are the one-GPU session's (`engine/stream/slo_scheduler.py`): stream-batch or
sequential, 1..`max_chunk_latents` latent frames per chunk, and the choice between them keeps the
same scores, margin and patience. Only the latency model differs, because the ranks work at
once. Rank r's work per micro-batch is `fixed_in[r](k) + fixed_out[r](k) + blocks[r](units)`:
the chunk entering (preprocess, VAE encode: by the chunk's latent frames), the chunk leaving (VAE
decode, postprocess: likewise), and its DiT blocks and head (by rows x latent frames). Each
part is a straight line fitted with forgetting (`StageModel`) to the windows of stage seconds the
ranks report (a TIMES round, the same the block scheduler uses), against the units rank 0 sent
in that window: every rank runs the same micro-batches, so rank 0 knows each window's work.

- stream-batch: n rows of k latents per tick, one chunk in and one out; P ticks are in flight,
  so a tick's period is the slowest rank, and a chunk leaves n*P periods after it entered;
- sequential: a chunk goes round the ring n times alone (one rank busy at a time), so its time
  through is the sum of every rank's work over the n passes, and that is also the period.
Latency adds the wait for a chunk's frames to arrive (4k input periods), as on one GPU. The
activations' transfers between ranks are not in the model (the ranks' windows time their work,
not their waits), so a plan's latency is priced a little low on a slow link.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom_live.engine.cache.vae_cache import FRAMES_PER_LATENT
from loom_live.engine.stream.slo_scheduler import Plan, SLOScheduler, StageModel

# How each stage a rank reports scales: with the latent frames entering, those leaving, or the
# rows x latent frames of the micro-batch (every other stage: the blocks, the head)
ENTERING = ("preprocess", "encode")
LEAVING = ("decode", "postprocess")


def stage_kind(stage: str) -> str:
    return "in" if stage in ENTERING else "out" if stage in LEAVING else "rows"


class PipelineSLO(SLOScheduler):
    """`SLOScheduler` whose plans are priced by the ranks' measured windows (module docstring)."""

    def __init__(self, ranks: int, steps: int, **kwargs: Any) -> None:
        self.ranks = ranks
        super().__init__(steps, **kwargs)
        self.stages: dict[str, StageModel] = {}

    def reset(self) -> None:
        super().reset()
        self.stages = {}

    def observe_windows(self, windows: Sequence[dict[str, Any]], work: dict[str, Sequence[float]]) -> None:
        """Learn from one TIMES round: `windows[r]["seconds"]` per stage on rank r, and the work
        rank 0 sent in that window, `work[kind] = (units, times)`: "in" the latent frames of the
        chunks that entered (and how many chunks), "out" those that left, "rows" the rows x latent
        frames of the micro-batches (and how many messages). Each part learns its mean time at
        its mean size; a part that did not run in the window learns nothing."""
        for w in windows:
            by_kind: dict[str, float] = {}
            for stage, seconds in w["seconds"].items():
                by_kind[stage_kind(stage)] = by_kind.get(stage_kind(stage), 0.0) + seconds
            for kind, seconds in by_kind.items():
                units, times = work.get(kind, (0.0, 0))
                if times > 0:
                    self.stages.setdefault(f"{w['rank']}:{kind}", StageModel()).observe(units / times, seconds / times)

    def _part(self, rank: int, kind: str, units: float) -> float:
        model = self.stages.get(f"{rank}:{kind}")
        return model.predict(units) if model is not None else 0.0

    def predict(self, plan: Plan) -> tuple[float, float]:
        """(output FPS, worst per-frame latency in seconds) of a plan on the ring."""
        k, n = plan.chunk_latents, self.steps
        chunk = [self._part(r, "in", k) + self._part(r, "out", k) for r in range(self.ranks)]
        if plan.mode == "sequential":
            through = sum(chunk[r] + n * self._part(r, "rows", k) for r in range(self.ranks))
            period = through
        else:
            period = max(chunk[r] + self._part(r, "rows", n * k) for r in range(self.ranks))
            through = n * self.ranks * period
        frames = FRAMES_PER_LATENT * k
        fps = frames / period if period > 0 else float("inf")
        fill = frames / self.input_fps if self.input_fps > 0 else 0.0
        return fps, fill + through

    def decide(self) -> Plan:
        if not self.stages:  # nothing measured yet: keep the plan
            return self.plan
        return super().decide()
