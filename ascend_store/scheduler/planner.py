"""Load or recompute: per request, whether the pool's hit is faster to load than to compute.

The engine measures both as it runs. Each step's metadata carries a step number; the
worker reports how long the step took (from its first hook to the end of its forward,
``WorkerReport.steps``), and the scheduler knows what the step computed and loaded:

- a step that loads nothing and computes fewer than ``MIN_TOKENS`` (a decode step) gives
  the cost of a step itself, whatever it computes (the forward's fixed part: on a small
  model most of a step);
- a step that loads nothing and computes more gives the compute cost per token beyond it;
- a step that loads gives the load cost per loaded token: its time beyond the step's own
  cost and what its computed tokens cost.

Both are exponential averages. A hit whose load is estimated dearer than recomputing it
(by more than ``margin``) is recomputed: the request reports no pool hit. Until both costs
are measured, and every ``explore_every``-th time a hit would be recomputed, the hit is
loaded, so a wrong estimate costs at most that one step and a tier that got faster is
found again. The costs are the pool's as a whole (every tier behind one backend): a hit
is loaded or recomputed whole.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TOKENS = 64  # a step computing fewer is decode-bound: its time says little of a prefill's


@dataclass
class StepCost:
    """One finished step as the scheduler planned it and the worker timed it."""

    computed_tokens: int
    loaded_tokens: int
    seconds: float


class LoadPlanner:
    def __init__(self, counters, margin: float = 0.1, explore_every: int = 16, alpha: float = 0.3):
        self.counters = counters
        self.margin = margin
        self.explore_every = explore_every
        self.alpha = alpha
        self.step_s: float | None = None
        self.compute_s_per_token: float | None = None
        self.load_s_per_token: float | None = None
        self._recomputed_in_a_row = 0

    def plan(self, hit_tokens: int) -> int:
        """How many of a request's ``hit_tokens`` pool tokens to load: all or none."""
        if hit_tokens <= 0:
            return 0
        c, ld = self.compute_s_per_token, self.load_s_per_token
        recompute = c is not None and ld is not None and ld > c * (1 + self.margin)
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
            self.load_s_per_token = self._avg(self.load_s_per_token, extra / step.loaded_tokens)

    def report(self) -> None:
        """The estimates as gauges of this stats interval."""
        if self.compute_s_per_token is not None:
            self.counters["planner_compute_us_per_token"] = self.compute_s_per_token * 1e6
        if self.load_s_per_token is not None:
            self.counters["planner_load_us_per_token"] = self.load_s_per_token * 1e6

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
