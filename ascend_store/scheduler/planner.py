"""Load or recompute: per request, whether the pool's hit is faster to load than to compute.

The engine measures both as it runs. Each step's metadata carries a step number; the
worker reports how long the step took (from its first hook to the end of its forward,
``WorkerReport.steps``), and the scheduler knows what the step computed and loaded:

- a step that loads nothing and computes fewer than ``MIN_TOKENS`` (a decode step) gives
  the cost of a step itself, whatever it computes (the forward's fixed part: on a small
  model most of a step);
- a step that loads nothing and computes more gives the compute cost per token beyond it;
- a step that loads gives what its loads cost: its time beyond the step's own cost and
  what its computed tokens cost.

The step's own cost and the compute cost per token are exponential averages. A load's cost
has a part per call (a lease's round trip, a throttled tier's latency) and a part per
token (bytes over a link): a least-squares line through the last ``history`` loading
steps, (loaded tokens, seconds), gives both. Loads of one size cannot tell the parts
apart; they are then charged per token, which over-prices larger hits, so a hit at least
``grow`` times the largest measured one is loaded once to measure it.

A hit whose load is estimated dearer than recomputing it (by more than ``margin``) is
recomputed: the request reports no pool hit. Until both costs are measured, and every
``explore_every``-th time a hit would be recomputed, the hit is loaded, so a wrong
estimate costs at most that one step and a tier that got faster is found again. With a
cost per call the cheaper choice is all or nothing, never a part of the hit. The costs are
the pool's as a whole (every tier behind one backend).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

MIN_TOKENS = 64  # a step computing fewer is decode-bound: its time says little of a prefill's


@dataclass
class StepCost:
    """One finished step as the scheduler planned it and the worker timed it."""

    computed_tokens: int
    loaded_tokens: int
    seconds: float


class LoadPlanner:
    def __init__(self, counters, margin: float = 0.1, explore_every: int = 16, alpha: float = 0.3,
                 history: int = 8, grow: float = 2.0):
        self.counters = counters
        self.margin = margin
        self.explore_every = explore_every
        self.alpha = alpha
        self.grow = grow
        self.step_s: float | None = None
        self.compute_s_per_token: float | None = None
        self.load_call_s: float | None = None
        self.load_s_per_token: float | None = None
        self._loads: deque[tuple[int, float]] = deque(maxlen=history)  # (loaded tokens, seconds)
        self._recomputed_in_a_row = 0

    def plan(self, hit_tokens: int) -> int:
        """How many of a request's ``hit_tokens`` pool tokens to load: all or none."""
        if hit_tokens <= 0:
            return 0
        c, ld = self.compute_s_per_token, self.load_s_per_token
        recompute = (c is not None and ld is not None
                     and self.load_call_s + ld * hit_tokens > c * hit_tokens * (1 + self.margin)
                     and hit_tokens < self.grow * max(n for n, _ in self._loads))
        if recompute and self._recomputed_in_a_row < self.explore_every:
            self._recomputed_in_a_row += 1
            self.counters["recomputes_planned"] += 1
            self.counters["recompute_tokens_planned"] += hit_tokens
            return 0
        self._recomputed_in_a_row = 0
        self.counters["loads_planned"] += 1
        self.counters["load_tokens_planned"] += hit_tokens
        return hit_tokens

    def observe(self, step: StepCost) -> None:
        if step.seconds <= 0:
            return
        fixed = self.step_s or 0.0
        if not step.loaded_tokens:
            if step.computed_tokens < MIN_TOKENS:
                self.step_s = self._avg(self.step_s, step.seconds)
            else:
                per_token = max(0.0, step.seconds - fixed) / step.computed_tokens
                self.compute_s_per_token = self._avg(self.compute_s_per_token, per_token)
        elif self.compute_s_per_token is not None:
            extra = max(0.0, step.seconds - fixed - step.computed_tokens * self.compute_s_per_token)
            self._loads.append((step.loaded_tokens, extra))
            self.load_call_s, self.load_s_per_token = self._fit()

    def _fit(self) -> tuple[float, float]:
        """(seconds per call, seconds per token) of the recent loads, both >= 0."""
        x, y = (np.array(v, dtype=np.float64) for v in zip(*self._loads))
        per_token = (0.0, float(y.sum() / x.sum()))
        if x.max() < 1.5 * x.min():  # one size: the parts cannot be told apart
            return per_token
        slope, call = np.polyfit(x, y, 1)
        if slope < 0:  # noise around a cost that does not grow with the hit
            return float(y.mean()), 0.0
        return (float(call), float(slope)) if call >= 0 else per_token

    def report(self) -> None:
        """The estimates as gauges of this stats interval."""
        if self.compute_s_per_token is not None:
            self.counters["planner_compute_us_per_token"] = self.compute_s_per_token * 1e6
        if self.load_s_per_token is not None:
            self.counters["planner_load_us_per_token"] = self.load_s_per_token * 1e6
            self.counters["planner_load_call_us"] = self.load_call_s * 1e6

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
