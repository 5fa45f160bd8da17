"""The scheduler's lookup cache: TTL, capacity and every invalidation path."""

from __future__ import annotations

from ascend_store.hit_cache import BlockHitCache
from ascend_store.stats import AscendStoreStats, IntervalCounters


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
