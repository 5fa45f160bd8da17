"""The load planner's decisions from measured step costs (scheduler/planner.py)."""

from __future__ import annotations

from ascend_store.ops.stats import IntervalCounters
from ascend_store.scheduler.planner import MIN_TOKENS, LoadPlanner, StepCost


def _planner(**kw) -> LoadPlanner:
    return LoadPlanner(IntervalCounters(), **kw)


def test_loads_until_both_costs_are_measured():
    p = _planner()
    assert p.plan(1000) == 1000  # nothing measured
    p.observe(StepCost(computed_tokens=500, loaded_tokens=0, seconds=0.5))  # 1 ms a token
    assert p.plan(1000) == 1000  # no load measured yet
    assert p.counters.total["loads_planned"] == 2


def test_a_slow_load_is_recomputed_and_re_measured_every_explore_every():
    p = _planner(explore_every=3)
    p.observe(StepCost(500, 0, 0.5))  # compute: 1 ms a token
    p.observe(StepCost(10, 1000, 5.01))  # 10 computed (10 ms), load: 5 ms a token
    assert p.load_s_per_token == 0.005
    assert [p.plan(100) for _ in range(5)] == [0, 0, 0, 100, 0]  # the fourth re-measures
    assert p.counters.total["recomputes_planned"] == 4
    assert p.counters.total["recompute_tokens_planned"] == 400
    assert p.counters.total["loads_planned"] == 1


def test_a_fast_load_is_loaded_and_a_load_that_got_fast_is_found_again():
    p = _planner(explore_every=1, alpha=1.0)
    p.observe(StepCost(500, 0, 0.5))
    p.observe(StepCost(0, 1000, 0.2))  # 0.2 ms a token: faster than computing
    assert p.plan(100) == 100
    p.observe(StepCost(0, 1000, 3.0))  # the tier got slow
    assert p.plan(100) == 0
    assert p.plan(100) == 100  # explore: loads once more
    p.observe(StepCost(0, 1000, 0.1))  # fast again
    assert p.plan(100) == 100 and p.plan(100) == 100


def test_a_steps_own_cost_is_not_charged_to_its_tokens_and_the_margin_holds():
    p = _planner(margin=0.1, alpha=1.0)
    p.observe(StepCost(MIN_TOKENS - 1, 0, 0.5))  # a decode step: the step's own cost
    assert p.compute_s_per_token is None and p.step_s == 0.5
    p.observe(StepCost(1000, 0, 1.5))  # 1 ms a token beyond it
    p.observe(StepCost(0, 1000, 1.55))  # 1.05 ms a token beyond it: dearer, within the margin
    assert p.plan(100) == 100
    p.report()
    assert round(p.counters.total["planner_compute_us_per_token"]) == 1000
    assert round(p.counters.total["planner_load_us_per_token"]) == 1050


def test_a_tier_whose_cost_is_per_call_loads_large_hits_and_recomputes_small_ones():
    """A throttled tier's cost is mostly per call (a lease's latency), not per token: from
    one hit size that cannot be told apart, so a hit twice the largest measured loads once,
    and the two sizes separate the parts."""
    p = _planner()
    p.observe(StepCost(1000, 0, 1.0))  # compute: 1 ms a token
    p.observe(StepCost(0, 500, 0.6))  # 500 tokens loaded in 0.6 s: 1.2 ms a token, or 0.6 s a call
    assert p.plan(500) == 0  # dearer than computing, whatever the split
    assert p.plan(2000) == 2000  # four times the size: measured once
    p.observe(StepCost(0, 2000, 0.62))
    assert p.load_call_s > 0.5 and p.load_s_per_token < 1e-4
    assert p.plan(2000) == 2000 and p.plan(4000) == 4000  # 0.6 s against 2 and 4 s
    assert p.plan(500) == 0  # 0.6 s against 0.5
    p.report()
    assert p.counters.total["planner_load_call_us"] > 5e5


def test_each_tier_has_its_price_and_a_hit_loads_the_prefix_that_pays():
    """Memory loads at 0.1 ms a token, the disk tier at 5 ms, computing costs 1 ms: a hit
    whose first two chunks are in memory and the rest on disk loads the two and computes the
    rest; all on disk it is recomputed; all in memory it loads."""
    p = _planner(alpha=1.0)
    p.observe(StepCost(1000, 0, 1.0))  # compute: 1 ms a token
    p.observe(StepCost(0, 1000, 0.1, by_tier=(1000, 0)))  # memory: 0.1 ms a token
    p.observe(StepCost(0, 500, 2.5, by_tier=(0, 500)))  # disk: 5 ms a token
    assert round(p.rates[0] * 1e4, 6) == 1 and round(p.rates[1] * 1e3, 6) == 5
    chunks = [256] * 4
    assert p.plan(chunks, [1, 1, 2, 2]) == 512
    assert p.plan(chunks, [2, 2, 2, 2]) == 0
    assert p.plan(chunks, [1, 1, 1, 1]) == 1024
    assert p.plan(chunks, [1, 2, 1, 1]) == 256  # only a prefix can load: the disk chunk ends it
    assert p.plan(chunks, [1, 1, 2, 2], partial=False) == 0  # a hybrid hit: all or nothing
    t = p.counters.total
    assert (t["loads_planned"], t["partial_loads_planned"], t["recomputes_planned"]) == (3, 2, 4)
    assert (t["load_tokens_planned"], t["recompute_tokens_planned"]) == (1792, 3328)
    p.report()
    assert round(p.counters.total["planner_disk_load_us_per_token"]) == 5000


def test_a_tier_never_loaded_from_is_measured_before_it_is_cut():
    p = _planner(alpha=1.0)
    p.observe(StepCost(1000, 0, 1.0))
    p.observe(StepCost(0, 1000, 3.0))  # memory is slow: 3 ms a token
    assert p.plan([256, 256], [1, 1]) == 0
    assert p.plan([256, 256], [1, 2]) == 512  # the disk's price is not known: load and measure
    p.observe(StepCost(0, 512, 0.8, by_tier=(256, 256)))  # 0.768 s of memory, so ~0.13 ms on disk
    assert p.rates[1] < 1e-3 and p.plan([256, 256], [2, 2]) == 512


def test_steps_mixing_tiers_give_each_tier_its_price():
    p = _planner(alpha=1.0)
    p.observe(StepCost(1000, 0, 1.0))
    for mem, disk in ((1000, 0), (250, 250), (200, 800), (100, 50)):
        p.observe(StepCost(0, mem + disk, 0.05 + mem * 1e-4 + disk * 2e-3, by_tier=(mem, disk)))
    assert abs(p.load_call_s - 0.05) < 1e-9
    assert abs(p.rates[0] - 1e-4) < 1e-9 and abs(p.rates[1] - 2e-3) < 1e-9
