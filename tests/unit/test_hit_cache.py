"""The scheduler's lookup cache: TTL, capacity and every invalidation path."""

from __future__ import annotations

from ascend_store.ops.stats import AscendStoreStats, IntervalCounters
from ascend_store.scheduler.hit_cache import BlockHitCache


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_answers_expire_after_ttl():
    clock = Clock()
    c = BlockHitCache(ttl_s=30, clock=clock)
    c.put("a", True)
    c.put("b", False)
    assert (c.get("a"), c.get("b"), c.get("c")) == (True, False, None)
    clock.t += 30.5
    assert (c.get("a"), c.get("b")) == (None, None)
    assert len(c) == 0


def test_capacity_drops_oldest_first():
    c = BlockHitCache(max_entries=3)
    for k in "abcd":
        c.put(k, True)
    assert c.get("a") is None and [c.get(k) for k in "bcd"] == [True, True, True]


def test_invalidate_drops_named_keys_only():
    c = BlockHitCache()
    c.put("a", False)
    c.put("b", True)
    c.invalidate(["a", "zz"])
    assert c.get("a") is None and c.get("b") is True
    assert c.counters["invalidations"] == 1


def test_more_evictions_drop_cached_hits_but_keep_misses():
    c = BlockHitCache()
    c.observe(("epoch1", 0))
    c.put("hit", True)
    c.put("miss", False)
    c.observe(("epoch1", 0))
    assert c.get("hit") is True
    c.observe(("epoch1", 3))
    assert c.get("hit") is None and c.get("miss") is False


def test_pool_restart_drops_everything():
    c = BlockHitCache()
    c.observe(("epoch1", 5))
    c.put("hit", True)
    c.put("miss", False)
    c.observe(("epoch2", 0))
    assert c.get("hit") is None and c.get("miss") is None


def test_interval_counters_report_deltas_and_stats_aggregate():
    ic = IntervalCounters()
    ic["loaded_bytes"] += 100
    ic["max_rpcs_per_step"] = 4
    first = ic.take()
    ic["loaded_bytes"] += 50
    assert first == {"loaded_bytes": 100, "max_rpcs_per_step": 4}
    assert ic.take() == {"loaded_bytes": 50, "max_rpcs_per_step": 4}
    assert ic.total["loaded_bytes"] == 150
    a = AscendStoreStats({"loaded_bytes": 1e9, "load_seconds": 0.5, "max_rpcs_per_step": 4})
    a.aggregate(AscendStoreStats({"loaded_bytes": 3e9, "load_seconds": 0.5, "max_rpcs_per_step": 2}))
    red = a.reduce()
    assert red["loaded_bytes"] == 4e9 and red["max_rpcs_per_step"] == 4 and red["load_gbps"] == 4.0
    assert AscendStoreStats({"x": 0}).is_empty()


def test_writer_can_re_reserve_its_own_uncommitted_object():
    """A writer whose commit was lost must not be locked out of its own key until the
    reservation expires; another writer still sees the object as being written."""
    from ascend_store.backends.base import Status
    from ascend_store.backends.local.index import PoolIndex

    ix = PoolIndex(1 << 20)
    (st, off), = ix.reserve(["k"], [1000], owner="w1")
    assert st is Status.OK
    assert ix.reserve(["k"], [1000], owner="w2") == [(Status.EXISTS, 0)]
    assert ix.reserve(["k"], [1000], owner="w1") == [(Status.OK, off)]
    assert ix.commit(["k"]) == [Status.OK]
    assert ix.reserve(["k"], [1000], owner="w1") == [(Status.EXISTS, 0)]


def test_named_deletions_drop_only_their_chunks():
    import numpy as np

    from ascend_store.backends.base import Generation, object_digest

    c = BlockHitCache()
    c.observe(Generation("e", 10, np.zeros(0, "<u8")))
    for k in ("h1", "state/h1", "h2"):
        c.put(k, True)
    c.put("h3", False)
    gone = np.array([object_digest("ns/g0/tp0of1/L0/h1"), object_digest("ns/g0/tp0of1/L5/h1")], "<u8")
    c.observe(Generation("e", 12, gone))  # two layers of chunk h1 went
    assert [c.get(k) for k in ("h1", "state/h1", "h2", "h3")] == [None, None, True, False]
    c.put("h1", True)
    c.observe(Generation("e", 12, gone))  # the same generation again: nothing new went
    assert c.get("h1") is True
    c.observe(Generation("e", 15, gone))  # 3 went, only 2 named: any hit may be gone
    assert [c.get(k) for k in ("h1", "h2", "h3")] == [None, None, False]


def test_steady_eviction_keeps_hot_hits_cached_with_a_real_pool(tmp_path):
    """A full pool evicts on every save while the scheduler keeps looking up a hot set:
    the hot chunks' cached hits must survive (>= 90%; dropping every hit on any eviction
    keeps none) and the evicted chunks' cached hits must go (none left stale)."""
    from tests.unit.test_local_pool import Pool

    layers, size, hot_n, rounds = 4, 64 * 2**10, 8, 40
    pool = Pool(str(tmp_path / "pool.sock"), capacity="4MiB").start()  # 64 objects: 16 chunks
    writer, sched = pool.client(timeout_s=5.0), pool.client(timeout_s=5.0, map_arena=False)
    cache = BlockHitCache()

    def keys(h):
        return [f"ns/g0/tp0of1/L{i}/{h}" for i in range(layers)]

    def save(h):
        _, view = writer.buffer()
        slots = writer.reserve(keys(h), [size] * layers)
        assert all(s.offset >= 0 and s.status == 0 for s in slots), slots
        assert writer.commit(keys(h)) == [0] * layers

    def lookup(hashes):  # as PoolScheduler._pool_hit_chunks: cached answers first
        cache.observe(sched.generation())
        ask = [h for h in hashes if cache.get(h) is None]
        if ask:
            found = sched.exists([k for h in ask for k in keys(h)])
            cache.observe(sched.generation())
            for i, h in enumerate(ask):
                cache.put(h, all(found[i * layers:(i + 1) * layers]))
        return len(hashes) - len(ask)

    try:
        hot = [f"{i:032x}" for i in range(hot_n)]
        for h in hot:
            save(h)
        lookup(hot)
        hot_keys = [k for h in hot for k in keys(h)]
        cold, kept, evictions = [], 0, [writer.stats()["evictions"]]
        for r in range(rounds):
            cold.append(f"c{r:031x}")
            save(cold[-1])
            evictions.append(writer.stats()["evictions"])
            assert all(s.status == 0 for s in writer.lease(hot_keys))  # loads keep the hot set fresh
            writer.release(hot_keys)
            lookup([cold[-1]])  # the new chunk becomes a cached hit, evicted a few rounds later
            kept += lookup(hot)
        steady = [b - a for a, b in zip(evictions[10:], evictions[11:])]
        assert steady and all(n > 0 for n in steady), evictions  # every save evicts once full
        assert kept >= 0.9 * rounds * hot_n, (kept, cache.counters)
        found = writer.exists([k for h in cold for k in keys(h)])
        evicted = [h for i, h in enumerate(cold) if not all(found[i * layers:(i + 1) * layers])]
        cache.observe(sched.generation())
        assert len(evicted) > 20 and [h for h in evicted if cache.get(h) is True] == []
    finally:
        writer.close()
        sched.close()
        pool.stop()


def test_a_cached_miss_ends_when_another_client_commits(tmp_path):
    """Two engines on one pool: the scheduler caches a miss, another engine stores the
    chunk; the next pool reply the scheduler sees reports the commit, and the miss is
    asked again (within its TTL) instead of hiding the new object for 30 s. Hits stay."""
    from tests.unit.test_local_pool import Pool

    pool = Pool(str(tmp_path / "pool.sock"), capacity="4MiB").start()
    writer, sched = pool.client(timeout_s=5.0), pool.client(timeout_s=5.0, map_arena=False)
    cache = BlockHitCache(ttl_s=30)
    try:
        writer.buffer()
        assert writer.reserve(["hot"], [4096])[0].status == 0 and writer.commit(["hot"]) == [0]
        found = sched.exists(["hot", "new"])
        cache.observe(sched.generation())
        cache.put("hot", found[0])
        cache.put("new", found[1])
        assert (cache.get("hot"), cache.get("new")) == (True, False)
        sched.exists(["other"])  # no commit in between: the miss stands
        cache.observe(sched.generation())
        assert cache.get("new") is False
        assert writer.reserve(["new"], [4096])[0].status == 0 and writer.commit(["new"]) == [0]
        sched.exists(["other"])  # any reply carries the pool's commit count
        cache.observe(sched.generation())
        assert (cache.get("hot"), cache.get("new")) == (True, None)
        assert sched.exists(["new"]) == [True]
    finally:
        writer.close()
        sched.close()
        pool.stop()
