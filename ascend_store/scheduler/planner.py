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

Each tier of the pool has its own cost per token (``backends.base``: the backend's memory,
the embedded pool's disk tier): the lookup says where each chunk of a hit is, and a loading
step's line has one slope per tier it loaded from.

A hit is a run of pieces (its chunks, then its tail), each in one tier. Loading the first
``k`` pieces and computing the rest costs a call, the pieces' tokens at their tier's price
and the rest at the compute price; the planner takes the cheapest ``k``. All of it is
loaded unless that is dearer than the cheapest choice by more than ``margin``; otherwise
the prefix that pays is loaded (none: the request reports no pool hit). A hit whose head
is in memory and whose rest went to a slow disk loads the head and computes the rest.
Until every tier the hit touches and the compute cost are measured, and every
``explore_every``-th time a hit would be cut, the whole hit is loaded, so a wrong estimate
costs at most that one step and a tier that got faster is found again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from ascend_store.backends.base import TIERS

MIN_TOKENS = 64  # a step computing fewer is decode-bound: its time says little of a prefill's


@dataclass
class StepCost:
    """One finished step as the scheduler planned it and the worker timed it."""

    computed_tokens: int
    loaded_tokens: int
    seconds: float
    by_tier: tuple[int, ...] | None = None  # loaded tokens per tier (from TIER_MEMORY); None: all in memory


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
        self.rates = np.full(TIERS, np.nan)  # seconds per loaded token, per tier (nan: not measured)
        self._loads: deque[tuple[np.ndarray, float]] = deque(maxlen=history)  # (tokens per tier, seconds)
        self._recomputed_in_a_row = 0
        # What each step computed and loaded per tier, by step number, until the worker's
        # timing of that step comes back (``steps_timed``).
        self._building = np.zeros(TIERS, dtype=np.int64)  # the step being built: tokens per tier
        self._steps: dict[int, tuple[int, tuple[int, ...]]] = {}

    @property
    def load_s_per_token(self) -> float | None:
        """The memory tier's price."""
        return None if np.isnan(self.rates[0]) else float(self.rates[0])

    def plan_hit(self, computed: int, chunk: int, tiers, end: int, partial: bool) -> tuple[int, np.ndarray]:
        """A request's hit over [computed, end): its chunks from the one holding ``computed``,
        each in its tier, the last piece ending at ``end`` (a tail, or a chunk cut at the
        prompt's end). Returns where its load ends and the tokens the load takes per tier."""
        tiers = np.asarray(tiers, dtype=np.int64)
        ends = np.minimum((np.arange(len(tiers)) + computed // chunk + 1) * chunk, end)
        ends[-1] = end
        tokens = np.diff(ends, prepend=computed)
        take = self.plan(tokens, tiers, partial)
        loaded = np.cumsum(tokens) <= take
        by_tier = np.bincount(tiers[loaded], tokens[loaded], minlength=TIERS + 1)[1:]
        return computed + take, by_tier.astype(np.int64)

    def plan(self, tokens, tiers=None, partial: bool = True) -> int:
        """How many of a hit's tokens to load: a prefix of its pieces (``tokens`` each, in
        ``tiers``; an int is one piece in memory). ``partial=False``: all or none (a hybrid
        hit must end where its recurrent state was saved)."""
        tokens = np.atleast_1d(np.asarray(tokens, dtype=np.int64))
        tiers = np.ones(len(tokens), dtype=np.int64) if tiers is None else np.asarray(tiers, dtype=np.int64)
        total = int(tokens.sum())
        if total <= 0:
            return 0
        take = total
        c = self.compute_s_per_token
        if c is not None and self._loads and total < self.grow * max(int(n.sum()) for n, _ in self._loads):
            price = self.rates[tiers - 1]
            if not np.isnan(price).any():
                done = np.cumsum(tokens)
                # cost[k]: load the first k pieces, compute the rest
                cost = np.concatenate(([c * total], self.load_call_s + np.cumsum(price * tokens)
                                       + c * (total - done)))
                if not partial:
                    cost = cost[[0, -1]]
                    done = done[-1:]
                k = int(np.argmin(cost))
                if k < len(cost) - 1 and cost[k] * (1 + self.margin) < cost[-1]:
                    take = int(done[k - 1]) if k else 0
        if take < total and self._recomputed_in_a_row < self.explore_every:
            self._recomputed_in_a_row += 1
            self.counters["recomputes_planned"] += 1
            self.counters["recompute_tokens_planned"] += total - take
            if take:
                self.counters["partial_loads_planned"] += 1
        else:
            take, self._recomputed_in_a_row = total, 0
        if take:
            self.counters["loads_planned"] += 1
            self.counters["load_tokens_planned"] += take
        return take

    def loading(self, by_tier: np.ndarray) -> None:
        """A request's planned load (tokens per tier) joins the step being built."""
        self._building += by_tier

    def step_built(self, step: int, computed: int) -> None:
        """The step being built is complete: it computes ``computed`` tokens."""
        self._steps[step] = (computed, tuple(self._building.tolist()))
        self._building[:] = 0
        if len(self._steps) > 4096:  # steps whose timing never came (no worker hook ran)
            self._steps.pop(next(iter(self._steps)))

    def steps_timed(self, seconds: dict[int, float]) -> None:
        """The worker's timings of built steps, by step number."""
        for step, s in seconds.items():
            built = self._steps.pop(step, None)
            if built is not None:
                computed, by_tier = built
                self.observe(StepCost(computed, sum(by_tier), s, by_tier))

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
            by_tier = np.zeros(TIERS)
            if step.by_tier is None:
                by_tier[0] = step.loaded_tokens
            else:
                by_tier[:len(step.by_tier)] = step.by_tier
            self._loads.append((by_tier, extra))
            self.load_call_s, self.rates = self._fit()

    def _fit(self) -> tuple[float, np.ndarray]:
        """(seconds per call, seconds per token of each tier) of the recent loads, all >= 0;
        nan for a tier none of them loaded from."""
        x = np.array([n for n, _ in self._loads])
        y = np.array([s for _, s in self._loads])
        seen = x.any(axis=0)
        rates = np.full(TIERS, np.nan)
        size = x.sum(axis=1)
        if size.max() >= 1.5 * size.min():  # sizes differ: the cost per call can be told apart
            a = np.column_stack([np.ones(len(y)), x[:, seen]])
            coef, _, rank, _ = np.linalg.lstsq(a, y, rcond=None)
            if rank == a.shape[1] and coef[0] >= 0:
                if (coef[1:] >= 0).all():
                    rates[seen] = coef[1:]
                    return float(coef[0]), rates
                if seen.sum() == 1:  # noise around a cost that does not grow with the hit
                    rates[seen] = 0.0
                    return float(y.mean()), rates
        a = x[:, seen]
        coef, _, rank, _ = np.linalg.lstsq(a, y, rcond=None)
        if seen.sum() > 1 and rank == a.shape[1] and (coef >= 0).all():
            rates[seen] = coef
        else:  # one tier, or tiers that cannot be told apart: one price for all of them
            rates[seen] = y.sum() / x.sum()
        return 0.0, rates

    def report(self) -> None:
        """The estimates as gauges of this stats interval."""
        if self.compute_s_per_token is not None:
            self.counters["planner_compute_us_per_token"] = self.compute_s_per_token * 1e6
        if self.load_call_s is not None:
            self.counters["planner_load_call_us"] = self.load_call_s * 1e6
        memory, disk = self.rates
        if not np.isnan(memory):
            self.counters["planner_load_us_per_token"] = float(memory) * 1e6
        if not np.isnan(disk):
            self.counters["planner_disk_load_us_per_token"] = float(disk) * 1e6

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)
