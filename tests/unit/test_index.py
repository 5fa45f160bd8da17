"""PoolIndex bookkeeping and the FreeList allocator (pure, no I/O)."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest

from ascend_store.backends.alloc import ALIGN, FreeList
from ascend_store.backends.base import Status
from ascend_store.backends.local.index import PoolIndex


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _aligned(n):
    return -(-n // ALIGN) * ALIGN


def _put(ix, key, size):
    [(status, off)] = ix.reserve([key], [size])
    assert status is Status.OK, (key, status)
    assert ix.commit([key]) == [Status.OK]
    return off


def _present(ix):
    return {k for k, _, ready, _ in ix.list("") if ready}


# -- statuses ----------------------------------------------------------------------------

def test_reserve_commit_lease_release_remove_statuses():
    ix = PoolIndex(64 * ALIGN)
    (s, off), = ix.reserve(["a"], [1000])
    assert s is Status.OK and off % ALIGN == 0
    assert ix.reserve(["a"], [1000]) == [(Status.EXISTS, 0)]  # reserved, not committed
    assert ix.commit(["a", "nope"]) == [Status.OK, Status.MISSING]
    assert ix.commit(["a"]) == [Status.MISSING]  # already committed
    assert ix.reserve(["a"], [1000]) == [(Status.EXISTS, 0)]  # committed
    assert ix.exists(["a", "nope"]) == [True, False]
    assert ix.lease(["a", "nope"]) == [(Status.OK, off, 1000), (Status.MISSING, 0, 0)]
    assert ix.remove(["a"]) == [Status.BUSY]
    assert ix.exists(["a"]) == [True]
    ix.release(["a"])
    assert ix.remove(["a", "nope"]) == [Status.OK, Status.MISSING]
    assert ix.exists(["a"]) == [False]
    assert ix.lease(["a"]) == [(Status.MISSING, 0, 0)]
    assert ix.stats()["used_bytes"] == 0


def test_two_leases_need_two_releases():
    ix = PoolIndex(8 * ALIGN)
    _put(ix, "a", 10)
    ix.lease(["a"])
    ix.lease(["a"])
    assert ix.stats()["leases"] == 2
    ix.release(["a"])
    assert ix.remove(["a"]) == [Status.BUSY]
    ix.release(["a"])
    ix.release(["a"])  # an extra release is ignored, never goes negative
    assert ix.stats()["leases"] == 0
    assert ix.remove(["a"]) == [Status.OK]


def test_uncommitted_objects_are_invisible():
    ix = PoolIndex(8 * ALIGN)
    ix.reserve(["w"], [100])
    assert ix.exists(["w"]) == [False]
    assert ix.lease(["w"]) == [(Status.MISSING, 0, 0)]
    st = ix.stats()
    assert st["objects"] == 0 and st["reserved"] == 1 and st["used_bytes"] == ALIGN
    ix.abort(["w"])
    assert ix.stats()["reserved"] == 0 and ix.stats()["used_bytes"] == 0
    assert ix.commit(["w"]) == [Status.MISSING]


def test_abort_does_not_touch_committed_objects():
    ix = PoolIndex(8 * ALIGN)
    _put(ix, "a", 100)
    ix.abort(["a", "unknown"])
    assert ix.exists(["a"]) == [True]


def test_reservations_do_not_overlap_and_are_aligned():
    ix = PoolIndex(16 * ALIGN)
    res = ix.reserve([f"k{i}" for i in range(8)], [1, ALIGN, ALIGN + 1, 7, 300, 512, 1024, 5])
    spans = []
    for (s, off), size in zip(res, [1, ALIGN, ALIGN + 1, 7, 300, 512, 1024, 5]):
        assert s is Status.OK
        assert off % ALIGN == 0
        spans.append((off, off + _aligned(size)))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in pairwise(spans))
    assert spans[-1][1] <= 16 * ALIGN


# -- eviction ----------------------------------------------------------------------------

def test_lru_eviction_order():
    ix = PoolIndex(4 * ALIGN)
    for k in "abcd":
        _put(ix, k, ALIGN)
    _put(ix, "e", ALIGN)
    assert _present(ix) == set("bcde")
    assert ix.stats()["evictions"] == 1
    _put(ix, "f", 2 * ALIGN)
    assert _present(ix) == set("def")


def test_recently_leased_object_survives_older_one():
    ix = PoolIndex(4 * ALIGN)
    for k in "abcd":
        _put(ix, k, ALIGN)
    ix.lease(["a"])
    ix.release(["a"])  # a is now the most recently used
    _put(ix, "e", ALIGN)
    assert _present(ix) == set("acde")
    _put(ix, "f", ALIGN)
    assert _present(ix) == set("adef")


def test_leased_object_is_never_evicted():
    ix = PoolIndex(4 * ALIGN)
    for k in "abcd":
        _put(ix, k, ALIGN)
    ix.lease(["a"])
    for i in range(10):
        _put(ix, f"x{i}", ALIGN)
        assert "a" in _present(ix)
    assert ix.lease(["a"])[0][0] is Status.OK


def test_reservations_are_never_evicted():
    ix = PoolIndex(2 * ALIGN)
    [(_, woff)] = ix.reserve(["w"], [ALIGN])
    aoff = _put(ix, "a", ALIGN)
    assert ix.reserve(["b"], [ALIGN]) == [(Status.OK, aoff)]  # a is evicted, not w
    assert _present(ix) == set()
    assert ix.reserve(["c"], [ALIGN]) == [(Status.NO_SPACE, 0)]  # only reservations left
    assert ix.commit(["w"]) == [Status.OK]
    assert ix.lease(["w"]) == [(Status.OK, woff, ALIGN)]


def test_no_space_when_everything_is_leased():
    ix = PoolIndex(4 * ALIGN)
    for k in "abcd":
        _put(ix, k, ALIGN)
    ix.lease(list("abcd"))
    assert ix.reserve(["e"], [1]) == [(Status.NO_SPACE, 0)]
    assert ix.stats()["no_space"] == 1
    assert _present(ix) == set("abcd")
    ix.release(["c"])
    assert ix.reserve(["e"], [1])[0][0] is Status.OK
    assert _present(ix) == set("abd")


def test_no_space_when_object_exceeds_capacity():
    ix = PoolIndex(4 * ALIGN)
    _put(ix, "a", ALIGN)
    assert ix.reserve(["big"], [4 * ALIGN + 1]) == [(Status.NO_SPACE, 0)]
    assert _present(ix) == {"a"}  # nothing was evicted for a hopeless request
    assert ix.stats()["evictions"] == 0
    assert ix.reserve(["full"], [4 * ALIGN])[0][0] is Status.OK  # exactly capacity evicts a


def test_eviction_frees_a_contiguous_segment():
    # a b c d in order; freeing only a and c leaves two separate holes: a 2-block object
    # must keep evicting until one contiguous segment fits.
    ix = PoolIndex(4 * ALIGN)
    for k in "abcd":
        _put(ix, k, ALIGN)
    ix.lease(["b"])
    [(s, off)] = ix.reserve(["e"], [2 * ALIGN])
    assert s is Status.OK
    assert "b" in _present(ix)
    boff = ix.lease(["b"])[0][1]
    assert not (off < boff + ALIGN and boff < off + 2 * ALIGN)


# -- expiry ------------------------------------------------------------------------------

def test_lease_ttl_expiry():
    clock = FakeClock()
    ix = PoolIndex(2 * ALIGN, lease_ttl_s=10.0, clock=clock)
    _put(ix, "a", ALIGN)
    _put(ix, "b", ALIGN)
    ix.lease(["a"])
    clock.now += 9.9
    ix.reap()
    assert ix.remove(["a"]) == [Status.BUSY]
    assert ix.stats()["expired_leases"] == 0
    clock.now += 0.2
    ix.reap()
    assert ix.stats()["leases"] == 0
    assert ix.stats()["expired_leases"] == 1
    assert ix.exists(["a"]) == [True]  # the object stays; only the pin is dropped
    assert ix.remove(["a"]) == [Status.OK]


def test_lease_renewal_extends_deadline():
    clock = FakeClock()
    ix = PoolIndex(2 * ALIGN, lease_ttl_s=10.0, clock=clock)
    _put(ix, "a", ALIGN)
    ix.lease(["a"])
    clock.now += 8
    ix.lease(["a"])
    clock.now += 8  # 16 s after the first lease, 8 s after the second
    ix.reap()
    assert ix.stats()["leases"] == 2


def test_reservation_expiry():
    clock = FakeClock()
    ix = PoolIndex(2 * ALIGN, reserve_ttl_s=5.0, clock=clock)
    ix.reserve(["w"], [ALIGN])
    clock.now += 4.9
    ix.reap()
    assert ix.stats()["reserved"] == 1
    clock.now += 0.2
    ix.reap()
    st = ix.stats()
    assert st["reserved"] == 0 and st["expired_reservations"] == 1 and st["used_bytes"] == 0
    assert ix.commit(["w"]) == [Status.MISSING]
    assert ix.exists(["w"]) == [False]


def test_committed_object_does_not_expire():
    clock = FakeClock()
    ix = PoolIndex(2 * ALIGN, reserve_ttl_s=5.0, lease_ttl_s=5.0, clock=clock)
    _put(ix, "a", ALIGN)
    clock.now += 1e6
    ix.reap()
    assert ix.exists(["a"]) == [True]


def test_a_live_readers_lease_outlasts_its_ttl_until_its_client_is_gone():
    clock, live = FakeClock(), {"r1", "r2"}
    ix = PoolIndex(2 * ALIGN, lease_ttl_s=1.0, clock=clock, alive=live.__contains__)
    off = _put(ix, "a", ALIGN)
    ix.lease(["a"], "r1")
    ix.lease(["a"], "r2")
    ix.lease(["a"], "r2")
    clock.now += 100
    ix.reap()
    st = ix.stats()
    assert st["leases"] == 3 and st["overdue_leases"] == 1 and st["expired_leases"] == 0
    assert ix.reserve(["b", "c"], [ALIGN, ALIGN]) == [(Status.OK, ALIGN - off), (Status.NO_SPACE, 0)]
    live.discard("r2")  # its process exited: only its leases go
    ix.reap()
    assert ix.stats()["leases"] == 1 and ix.stats()["expired_leases"] == 2
    assert ix.remove(["a"]) == [Status.BUSY]
    ix.release(["a"], "r2")  # a release by another owner takes nothing of r1's
    assert ix.remove(["a"]) == [Status.BUSY]
    ix.release(["a"], "r1")
    ix.reap()
    assert ix.stats()["overdue_leases"] == 0
    assert ix.remove(["a"]) == [Status.OK]


def test_a_live_writers_reservation_outlasts_its_ttl_until_its_client_is_gone():
    clock, live = FakeClock(), {"w"}
    ix = PoolIndex(2 * ALIGN, reserve_ttl_s=1.0, clock=clock, alive=live.__contains__)
    [(status, off)] = ix.reserve(["k"], [ALIGN], owner="w")
    clock.now += 100
    ix.reap()
    assert ix.stats()["overdue_reservations"] == 1 and ix.stats()["reserved"] == 1
    # Its memory is not handed out, so its late writes land in its own object.
    assert ix.reserve(["x", "y"], [ALIGN, ALIGN]) == [(Status.OK, ALIGN - off), (Status.NO_SPACE, 0)]
    ix.abort(["x"])
    assert ix.commit(["k"], "w") == [Status.OK]
    ix.reserve(["z"], [ALIGN], owner="w")
    live.clear()
    clock.now += 100
    ix.reap()
    st = ix.stats()
    assert st["reserved"] == 0 and st["expired_reservations"] == 1 and st["overdue_reservations"] == 0


def test_only_the_writer_commits_or_aborts_its_reservation():
    ix = PoolIndex(4 * ALIGN)
    ix.reserve(["k"], [100], owner="w1")
    assert ix.commit(["k"], "w2") == [Status.MISSING]
    ix.abort(["k"], "w2")
    assert ix.stats()["reserved"] == 1
    ix.abort(["k"], "w1")
    assert ix.stats()["reserved"] == 0
    ix.reserve(["k"], [100], owner="w1")
    assert ix.commit(["k"]) == [Status.OK]  # a client that sends no owner is not checked


# -- FreeList ----------------------------------------------------------------------------

@pytest.mark.parametrize("order", [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)])
def test_freelist_coalesces_neighbours(order):
    fl = FreeList(3 * 1024)
    offs = [fl.alloc(1024) for _ in range(3)]
    assert sorted(offs) == [0, 1024, 2048]
    assert fl.alloc(1) is None
    assert fl.free_bytes == 0
    sizes = [fl.free(offs[i], 1024) for i in order]
    assert sizes[-1] == 3 * 1024
    assert fl.free_bytes == 3 * 1024
    assert fl.alloc(3 * 1024) == 0  # one segment of the full size


def test_freelist_middle_hole_and_exact_reuse():
    fl = FreeList(4096)
    a, b, c = fl.alloc(1024), fl.alloc(512), fl.alloc(1024)
    assert fl.free(b, 512) == 512
    assert fl.alloc(512) == b  # exact-size segment reused
    assert fl.free(a, 1024) == 1024
    assert fl.free(c, 1024) == 1024 + 1536  # merges with the tail
    assert fl.free_bytes == 4096 - 512


def test_freelist_zero_capacity():
    fl = FreeList(0)
    assert fl.alloc(1) is None
    assert fl.free_bytes == 0


# -- randomized invariants ---------------------------------------------------------------

def test_randomized_no_overlap_and_accounting():
    rng = random.Random(0)
    capacity = 64 * ALIGN
    clock = FakeClock()
    ix = PoolIndex(capacity, lease_ttl_s=3.0, reserve_ttl_s=5.0, clock=clock)
    placed: dict[str, tuple[int, int]] = {}  # key -> (offset, aligned size) as handed out
    leased: list[str] = []
    counts = dict.fromkeys(Status, 0)
    for step in range(4000):
        op = rng.random()
        key = f"k{rng.randrange(120)}"
        if op < 0.35:
            size = rng.choice([1, 100, ALIGN, ALIGN + 1, 3 * ALIGN, 7 * ALIGN + 5, 20 * ALIGN])
            [(s, off)] = ix.reserve([key], [size])
            counts[s] += 1
            if s is Status.OK:
                placed[key] = (off, _aligned(size))
        elif op < 0.6:
            ix.commit([key])
        elif op < 0.72:
            [(s, off, size)] = ix.lease([key])
            if s is Status.OK:
                assert placed[key][0] == off
                leased.append(key)
        elif op < 0.84 and leased:
            ix.release([leased.pop(rng.randrange(len(leased)))])
        elif op < 0.9:
            ix.remove([key])
        elif op < 0.95:
            ix.abort([key])
        else:
            clock.now += rng.random() * 2
            ix.reap()

        live = {k for k, *_ in ix.list("")}
        spans = sorted(placed[k] for k in live)
        for (o1, n1), (o2, _) in pairwise(spans):
            assert o1 + n1 <= o2, f"step {step}: overlap"
        assert all(o >= 0 and o + n <= capacity for o, n in spans)
        used = sum(n for _, n in spans)
        st = ix.stats()
        assert st["used_bytes"] == used, f"step {step}"
        assert used + ix.free.free_bytes == capacity
        # Free segments lie outside every live object.
        free = sorted(ix.free._by_off.items())
        assert sum(n for _, n in free) == ix.free.free_bytes
        merged = sorted(spans + free)
        for (o1, n1), (o2, _) in pairwise(merged):
            assert o1 + n1 <= o2, f"step {step}: free segment overlaps an object"
    # The run exercised the interesting paths.
    assert counts[Status.OK] > 100 and counts[Status.EXISTS] > 50 and counts[Status.NO_SPACE] > 0
    assert ix.stats()["evictions"] > 50
    assert ix.stats()["expired_reservations"] > 0


# -- objects gone, by digest -------------------------------------------------------------

def _digests(blob):
    return [int.from_bytes(blob[i:i + 8], "little") for i in range(0, len(blob), 8)]


def test_gone_names_evicted_and_removed_objects_in_order():
    from ascend_store.backends.base import object_digest

    ix = PoolIndex(4 * ALIGN, gone_ring=4)
    for k in ("ns/L0/a", "ns/L0/b", "ns/L0/c"):
        _put(ix, k, ALIGN)
    ix.reserve(["ns/L0/w"], [ALIGN // 2])  # a reservation: its abort is no deletion
    ix.abort(["ns/L0/w"])
    assert ix.gone == 0 and ix.gone_since(0) == b""
    _put(ix, "ns/L0/d", ALIGN)
    _put(ix, "ns/L1/e", ALIGN)  # evicts a
    assert ix.remove(["ns/L0/c"]) == [Status.OK]
    assert ix.gone == 2
    assert _digests(ix.gone_since(0)) == [object_digest("ns/L0/a"), object_digest("ns/L0/c")]
    assert _digests(ix.gone_since(1)) == [object_digest("c")]  # the chunk's name is the last component
    assert ix.gone_since(2) == b"" and ix.gone_since(3) is None  # from the future: another epoch
    for k in ("f", "g", "h", "i"):  # 4 more go: the ring of 4 forgot the first two
        _put(ix, f"ns/L1/{k}", 2 * ALIGN)
    assert ix.gone >= 6
    assert ix.gone_since(0) is None and len(_digests(ix.gone_since(ix.gone - 4))) == 4
