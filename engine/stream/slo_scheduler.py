"""SLO-aware scheduling: pick stream-batch or sequential and the chunk size from measured costs.

With n denoising steps, a chunk of k latent frames (4k pixel frames) costs
- sequential: encode(k) + n * dit(1 row, k) + decode(k) per chunk; a chunk leaves after one pass;
- stream-batch: encode(k) + dit(n rows, k) + decode(k) per forward, one chunk out per forward,
  but each chunk needs n forwards to get through.
Throughput is 4k frames per period; a frame's latency is the wait for its chunk to fill
(4k input frame periods) plus the time to get through. An online latency model (a per-stage
straight line, time = fixed + per_unit * units, fitted to recent measurements with exponential
forgetting) predicts both for every plan, so no profiling run is needed. The scheduler keeps
the current plan unless another one is better by a margin for several consecutive chunks
(hysteresis), so timing noise never makes it flap, and it only moves while the current plan
misses the SLO: a switch drains the stream-batch pipeline, which a performer would see.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from loom_live.engine.cache.vae_cache import FRAMES_PER_LATENT

FORGET = 0.9  # weight of history in the per-stage fits
HYSTERESIS = 0.15  # a new plan must be this much better...
PATIENCE = 3  # ...for this many consecutive decisions
KEEP_UP = 1.5  # a plan keeps up with its input at this many times the input's frame rate
MAX_CHUNK_LATENTS = 4
INPUT_WINDOW = 64  # arrivals the input rate is measured over
PRIOR_FIXED_FRACTION = 0.3  # until two work sizes are measured, assume this share of a stage is fixed cost


@dataclass(frozen=True)
class Plan:
    mode: str  # "batch" or "sequential"
    chunk_latents: int  # latent frames per forward


def allowed_modes(setting: str) -> tuple[str, ...]:
    """The modes a `stream.mode` setting lets the scheduler choose from (auto: both, batch first)."""
    return ("batch", "sequential") if setting == "auto" else (setting,)


class StageModel:
    """time = fixed + per_unit * units, by weighted least squares with forgetting."""

    def __init__(self) -> None:
        self._sw = self._su = self._st = self._suu = self._sut = 0.0

    def observe(self, units: float, seconds: float) -> None:
        f = FORGET
        self._sw = f * self._sw + 1.0
        self._su = f * self._su + units
        self._st = f * self._st + seconds
        self._suu = f * self._suu + units * units
        self._sut = f * self._sut + units * seconds

    @property
    def seen(self) -> bool:
        return self._sw > 0

    def predict(self, units: float) -> float:
        if not self.seen:
            return 0.0
        mean_u, mean_t = self._su / self._sw, self._st / self._sw
        var = self._suu / self._sw - mean_u**2
        if var <= 1e-9 * max(mean_u**2, 1.0):
            # One work size seen so far: assume part of it is fixed cost, which makes untried larger
            # batches look a little cheaper per unit; trying one then measures the real line.
            return mean_t * (PRIOR_FIXED_FRACTION + (1 - PRIOR_FIXED_FRACTION) * units / mean_u)
        slope = max((self._sut / self._sw - mean_u * mean_t) / var, 0.0)
        return max(mean_t + slope * (units - mean_u), 0.0)


class SLOScheduler:
    def __init__(self, steps: int, target_fps: float = 0.0, latency_budget_s: float = 1.0,
                 initial: Plan = Plan("batch", 1), allowed_modes: tuple[str, ...] = ("batch", "sequential"),
                 max_chunk_latents: int = MAX_CHUNK_LATENTS, overlapped: bool = False) -> None:
        self.steps = steps
        self.overlapped = overlapped  # encode, denoise and decode of neighbouring chunks share the GPU
        self.target_fps = target_fps
        self.budget = latency_budget_s
        self.plan = initial
        self.input_fps = target_fps or 0.0
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=INPUT_WINDOW)
        self.max_chunk_latents = max_chunk_latents
        self.allow_modes(allowed_modes)
        self.stages = {"encode": StageModel(), "dit": StageModel(), "decode": StageModel()}

    def reset(self) -> None:
        """A new stream: the first allowed mode at one latent per chunk, and nothing learnt yet."""
        self.plan = Plan(self.modes[0], 1)
        self.input_fps = self.target_fps or 0.0
        self._arrivals.clear()
        self.allow_modes(self.modes)
        self.stages = {"encode": StageModel(), "dit": StageModel(), "decode": StageModel()}

    def hold(self, plan: Plan) -> None:
        """Use `plan` from the next chunk (a warm-up streaming each plan); ValueError for one not allowed."""
        if plan not in self.candidates:
            raise ValueError(f"plan {plan}: not one of the allowed plans {self.candidates}")
        self.plan, self._challenger, self._streak = plan, None, 0

    def set_steps(self, steps: int) -> None:
        """A new number of denoising steps (rows per DiT forward) from the next decision on."""
        self.steps = steps

    def set_targets(self, target_fps: float, latency_budget_s: float) -> None:
        """New service-level targets (0 FPS: follow the input rate)."""
        self.target_fps, self.budget = target_fps, latency_budget_s

    def allow_modes(self, modes: tuple[str, ...]) -> None:
        """Restrict the plans to these modes (a user pinning batch or sequential). A pinned mode streams its
        one-latent plan, as a stream pinned from the start does: the sessions decide only in auto, so a chunk
        size auto had picked would otherwise stay for good."""
        self.modes = tuple(modes)
        self.candidates = [Plan(m, k) for m in modes for k in range(1, self.max_chunk_latents + 1)]
        if len(self.modes) == 1:
            self.plan = Plan(self.modes[0], 1)
        elif self.plan not in self.candidates:
            self.plan = Plan(modes[0], self.plan.chunk_latents if self.plan.chunk_latents <= self.max_chunk_latents
                             else 1)
        self._challenger, self._streak = None, 0

    def observe(self, stage: str, units: float, seconds: float) -> None:
        """Feed one measured stage time; units: latent frames (encode/decode), rows x frames (dit)."""
        self.stages[stage].observe(units, seconds)

    def observe_input(self, frames: int, now: float) -> None:
        """`frames` arrived at `now` (seconds): the input rate is the frames after the first of the
        recent arrivals over the time they span."""
        self._arrivals.append((now, frames))
        first, last = self._arrivals[0][0], self._arrivals[-1][0]
        if last > first:
            self.observe_input_rate(sum(n for _, n in list(self._arrivals)[1:]) / (last - first))

    def observe_input_rate(self, fps: float) -> None:
        if fps > 0:
            self.input_fps = fps

    def predict(self, plan: Plan) -> tuple[float, float]:
        """(output FPS, worst per-frame latency in seconds) of a plan under the current model."""
        k, n = plan.chunk_latents, self.steps
        enc, dec = self.stages["encode"].predict(k), self.stages["decode"].predict(k)
        sequential = plan.mode == "sequential"
        dit = n * self.stages["dit"].predict(k) if sequential else self.stages["dit"].predict(n * k)
        if self.overlapped:
            # The stages of neighbouring chunks run at once; once the GPU is full their measured
            # spans stretch until the longest one is the period (docs/performance.md: the DiT span
            # matched the chunk period). A chunk's own path is still
            # encode, its forwards one period apart, decode.
            period = max(enc, dit, dec)
            through = enc + dit + dec + (0 if sequential else (n - 1) * period)
        else:
            period = enc + dit + dec
            through = period if sequential else n * period
        frames = FRAMES_PER_LATENT * k
        fps = frames / period if period > 0 else float("inf")
        fill = frames / self.input_fps if self.input_fps > 0 else 0.0
        return fps, fill + through

    def _score(self, plan: Plan, paced: bool) -> tuple[int, float]:
        """Higher is better. Tier 3 meets the rate and the latency budget (then the lowest latency
        wins with a target rate, the highest FPS without); tier 2 meets the budget only (highest
        FPS wins); a plan that misses the budget is tier 1 if it keeps up with the input with room
        to spare, else tier 0, the lowest latency winning in both (never trade more lag for speed).
        A live plan slower than its input has no steady latency: frames queue, then drop. Keeping up
        counts only while the current plan does: a stream pushed as fast as the engine takes it has
        an input rate that is the engine's own, which every faster plan would seem to beat (`paced`:
        the current plan keeps up)."""
        fps, latency = self.predict(plan)
        meets_rate = self.target_fps <= 0 or fps >= self.target_fps
        if latency > self.budget:
            return (1 if not paced or fps >= KEEP_UP * self.input_fps else 0), -latency
        if meets_rate:
            return 3, (-latency if self.target_fps > 0 else fps)
        return 2, fps

    def decide(self) -> Plan:
        """Called once per chunk; returns the plan to use next (switches only with hysteresis)."""
        if not all(s.seen for s in self.stages.values()):
            return self.plan
        paced = self.input_fps > 0 and self.predict(self.plan)[0] >= KEEP_UP * self.input_fps
        cur_tier, cur_val = self._score(self.plan, paced)
        if cur_tier == 3:  # the current plan keeps the SLO: do not churn (a switch drains the pipeline)
            self._challenger, self._streak = None, 0
            return self.plan
        scores = {p: self._score(p, paced) for p in self.candidates}
        best = max(self.candidates, key=scores.__getitem__)
        best_tier, best_val = scores[best]
        better = best != self.plan and (
            best_tier > cur_tier or (best_tier == cur_tier and _improves(best_val, cur_val))
        )
        if not better:
            self._challenger, self._streak = None, 0
            return self.plan
        self._streak = self._streak + 1 if best == self._challenger else 1
        self._challenger = best
        if self._streak >= PATIENCE:
            self.plan, self._challenger, self._streak = best, None, 0
        return self.plan


def _improves(new: float, old: float) -> bool:
    """new beats old by the hysteresis margin (values are 'higher is better', may be negative)."""
    return new - old > HYSTERESIS * abs(old)
