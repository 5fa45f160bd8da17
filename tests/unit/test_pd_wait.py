"""The consumer's wait for a producer's objects (pd_wait.py), on a clock the test moves.

The e2e side (a real producer answering before its commit, behind deploy/proxy.py) is
tests/e2e/test_pd_serving.py; here: who waits, how often the pool is asked, the deadline."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from ascend_store.scheduler.pd_wait import POLL_S, PREFILLED, ProducerWait


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _request(rid="r", prefilled=True, n=97):
    params = {PREFILLED: True} if prefilled else {"other": 1}
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=list(range(n)))


def test_only_marked_requests_wait_and_only_when_on():
    clock, counters = Clock(), Counter()
    assert not ProducerWait(0.0, counters, clock).holds(_request(), 32, 96)  # off
    on = ProducerWait(2.0, counters, clock)
    assert not on.holds(_request(prefilled=False), 32, 96)  # not marked by the proxy
    assert not on.holds(SimpleNamespace(request_id="x", kv_transfer_params=None), 32, 96)
    assert not on.holds(_request(), 96, 96)  # everything is there: no wait, nothing counted
    assert counters == Counter()


def test_waits_polling_at_most_every_poll_interval_until_the_objects_land():
    clock, counters = Clock(), Counter()
    wait = ProducerWait(2.0, counters, clock)
    assert wait.holds(_request(), 32, 96)
    assert wait.too_soon("r")  # asked again at once: answered without the pool
    clock.now += POLL_S
    assert not wait.too_soon("r")
    assert wait.holds(_request(), 64, 96)  # more landed, not all
    clock.now += POLL_S
    assert not wait.holds(_request(), 96, 96)  # all landed
    assert not wait.too_soon("r")
    assert not wait.holds(_request(), 32, 96)  # asked again later (e.g. preempted): no new wait
    assert counters == Counter(producer_waits=1)


def test_the_deadline_counts_from_the_first_ask_and_ends_the_wait():
    clock, counters = Clock(), Counter()
    wait = ProducerWait(2.0, counters, clock)
    assert wait.holds(_request(), 0, 96)
    clock.now += 1.9
    assert wait.holds(_request(), 32, 96)  # still within 2 s of the first ask
    clock.now += 0.2
    assert not wait.holds(_request(), 32, 96)  # past it: go on with 32 tokens, recompute the rest
    assert counters == Counter(producer_waits=1, producer_wait_timeouts=1)
    assert not wait.holds(_request(), 32, 96)  # asked again (no room yet): no second wait
    wait.forget("r")  # request_finished
    assert wait.holds(_request(), 32, 96)  # a new request under that id waits afresh
