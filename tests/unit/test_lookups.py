"""The scheduler's lookups (lookups.py) against a real local pool: one call per step for
every request asked in it, answers from the cache without a call, and a frozen pool that
costs a request at most the deadline and the engine's thread nothing."""

from __future__ import annotations

import os
import signal
import threading
import time

from ascend_store.backends.base import Status
from ascend_store.backends.guard import GuardedBackend
from ascend_store.common.keys import KeySpace
from ascend_store.ops.stats import IntervalCounters
from ascend_store.scheduler.hit_cache import BlockHitCache
from ascend_store.scheduler.lookups import TAIL_TAG, LookupState, PoolLookups

KS = KeySpace("ns", "tp0of1")


def _store(client, keys: list[str]) -> None:
    slots = client.reserve(keys, [64] * len(keys))
    assert all(s.status is Status.OK for s in slots)
    assert client.commit(keys) == [Status.OK] * len(keys)


def _lookups(guard, deadline_s: float = 0.2, cache: bool = True) -> PoolLookups:
    return PoolLookups(guard, [KS], [0], [], BlockHitCache() if cache else None, IntervalCounters(),
                       deadline_s)


def _no_tails(c: int) -> list[str]:
    return []


def _until_answered(lk: PoolLookups, states, chains, timeout_s: float = 5.0):
    """Ask every request each 'step' until all are answered; returns the hits and steps."""
    hits: list = [None] * len(states)
    steps = 0
    deadline = time.monotonic() + timeout_s
    while any(h is None for h in hits):
        assert time.monotonic() < deadline, "lookups never answered"
        for i, (st, chain) in enumerate(zip(states, chains)):
            if hits[i] is None:
                hits[i] = lk.lookup(st, chain, 0, len(chain), _no_tails)
        lk.flush()
        steps += 1
        time.sleep(0.005)
    return hits, steps


def test_requests_of_one_step_share_one_call_and_cached_ones_none(pool):
    client = pool.client()
    guard = GuardedBackend(client, "test pool")
    lk = _lookups(guard)
    shared = [f"{i:032x}" for i in range(4)]
    chains = [shared + [f"{100 + r:030x}{j:02x}" for j in range(2)] for r in range(8)]
    _store(client, [KS.key(0, h) for h in shared + chains[0][4:]])
    states = [LookupState() for _ in chains]
    hits, _ = _until_answered(lk, states, chains)
    assert [h.chunks for h in hits] == [6] + [4] * 7
    assert guard.calls["lookup"] == 1  # eight requests, 16 distinct keys, one call
    assert lk.counters.total["lookup_rpcs"] == 1
    # Asked again (new requests, same prompts): the cache answers, no call.
    again, steps = _until_answered(lk, [LookupState() for _ in chains], chains)
    assert [h.chunks for h in again] == [6] + [4] * 7 and steps == 1
    assert guard.calls["lookup"] == 1
    lk.close()
    guard.close()


def test_requests_asked_together_are_answered_in_the_same_step(pool, monkeypatch):
    """The reply lands while the scheduler is between two requests of a step: neither sees
    it before the next step, so the two load in one step (a shared prefix leased once)."""
    client = pool.client()
    gate, real = threading.Event(), client.tiers
    monkeypatch.setattr(client, "tiers", lambda keys: (gate.wait(5), real(keys))[1])
    guard = GuardedBackend(client, "test pool")
    lk = _lookups(guard, deadline_s=5.0)
    chains = [[f"{r:030x}{j:02x}" for j in range(2)] for r in range(2)]
    _store(client, [KS.key(0, h) for chain in chains for h in chain])
    states = [LookupState(), LookupState()]
    assert [lk.lookup(st, c, 0, 2, _no_tails) for st, c in zip(states, chains)] == [None, None]
    lk.flush()
    assert lk.lookup(states[0], chains[0], 0, 2, _no_tails) is None  # next step, not in yet
    gate.set()
    deadline = time.monotonic() + 5
    while lk._queued is not None or lk._busy_since is not None:  # the reply is in
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert lk.lookup(states[1], chains[1], 0, 2, _no_tails) is None  # the same step
    lk.flush()
    hits = [lk.lookup(st, c, 0, 2, _no_tails) for st, c in zip(states, chains)]
    assert [h.chunks for h in hits] == [2, 2]
    lk.close()
    guard.close()


def test_until_the_pool_first_answers_requests_wait_for_its_set_up(pool, monkeypatch):
    """A store client still connecting when the engine's first requests come: they wait up
    to ``first_deadline_s`` (and hit); once the pool has answered, ``deadline_s`` holds."""
    client = pool.client()
    real = client.tiers
    monkeypatch.setattr(client, "tiers", lambda keys: (time.sleep(0.5), real(keys))[1])
    guard = GuardedBackend(client, "test pool")
    lk = PoolLookups(guard, [KS], [0], [], None, IntervalCounters(), 0.2, first_deadline_s=5.0)
    chains = [[f"{r:030x}{j:02x}" for j in range(2)] for r in range(2)]
    _store(client, [KS.key(0, h) for chain in chains for h in chain])
    first, _ = _until_answered(lk, [LookupState()], chains[:1])
    assert first[0].chunks == 2 and lk.counters.total["lookup_timeouts"] == 0
    later, _ = _until_answered(lk, [LookupState()], chains[1:])
    assert later[0].chunks == 0 and lk.counters.total["lookup_timeouts"] == 1
    lk.close()
    guard.close()


def test_a_partial_hit_asks_its_tails_in_a_second_round(pool):
    client = pool.client()
    guard = GuardedBackend(client, "test pool")
    lk = _lookups(guard)
    chain = [f"{i:032x}" for i in range(4)]
    tails = {c: [f"{c:02x}{k:030x}" for k in range(1, 4)] for c in range(5)}
    _store(client, [KS.key(0, h) for h in chain[:2]] + [KS.key(0, tails[2][1])])
    st = LookupState()
    hit = None
    while hit is None:
        hit = lk.lookup(st, chain, 0, 4, lambda c: tails[c])
        lk.flush()
        time.sleep(0.01)
    assert (hit.chunks, hit.tail) == (2, (tails[2][1], 2))
    assert guard.calls["lookup"] == 2  # chunks (and tails at 0 and 4), then the tails at 2
    assert lk.cache.get(TAIL_TAG + tails[2][0]) == 0
    lk.close()
    guard.close()


def test_a_frozen_pool_costs_a_request_the_deadline_and_the_thread_nothing(pool):
    client = pool.client(timeout_s=2.0)
    guard = GuardedBackend(client, "test pool")
    lk = _lookups(guard, deadline_s=0.2)
    chain = [f"{i:032x}" for i in range(3)]
    os.kill(pool.pid, signal.SIGSTOP)
    try:
        st = LookupState()
        t0 = time.monotonic()
        slowest = 0.0
        hit = None
        while hit is None:
            t = time.monotonic()
            hit = lk.lookup(st, chain, 0, 3, _no_tails)
            lk.flush()
            slowest = max(slowest, time.monotonic() - t)
            time.sleep(0.01)
        waited = time.monotonic() - t0
        assert hit.chunks == 0 and 0.2 <= waited < 1.0
        assert slowest < 0.05  # no call on this thread ever waited for the pool
        assert lk.counters.total["lookup_timeouts"] == 1
        # The thread is still stuck in that call: the next request misses at once.
        t = time.monotonic()
        assert lk.lookup(LookupState(), chain, 0, 3, _no_tails).chunks == 0
        assert time.monotonic() - t < 0.05
        assert lk.counters.total["lookups_skipped"] == 1
    finally:
        os.kill(pool.pid, signal.SIGCONT)
    _store(client, [KS.key(0, h) for h in chain])
    time.sleep(0.6)  # the breaker's first backoff
    hits, _ = _until_answered(lk, [LookupState()], [chain])
    assert hits[0].chunks == 3  # back
    lk.close()
    guard.close()


def test_an_engine_spinning_through_empty_steps_gets_its_answer_in_a_few(pool):
    """A request waiting for its lookup leaves vLLM nothing to run: the engine loops through
    empty steps on the GIL. The lookup thread must get the GIL from those steps at once,
    not after the interpreter's switch interval (5 ms, thousands of empty steps), twice
    (to send the question, and to take the reply)."""
    client = pool.client()
    guard = GuardedBackend(client, "test pool")
    lk = _lookups(guard, deadline_s=5.0)
    chain = [f"{i:032x}" for i in range(4)]
    _store(client, [KS.key(0, h) for h in chain])
    waited = []
    for r in range(3):
        st, steps, hit = LookupState(), 0, None
        chain = [f"{100 + r:032x}"] + chain  # a chunk the cache does not know
        deadline = time.monotonic() + 5
        while hit is None:  # an empty engine step: no sleep, only Python
            assert time.monotonic() < deadline, "lookups never answered"
            hit = lk.lookup(st, chain, 0, len(chain), _no_tails)
            lk.flush()
            steps += 1
        waited.append(steps)
    assert max(waited) <= 50, f"answered after {waited} empty steps"  # before: 2,567 to 5,241
    lk.close()
    guard.close()
