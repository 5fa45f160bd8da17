"""The local pool's disk tier on real pool processes: spill, promote, restart, corruption, capacity,
and the tier the scheduler's lookups see for each chunk.

About 15 s in all (each test starts one or two pool processes of a 1 MiB arena)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ascend_store.backends.base import TIER_DISK, TIER_MEMORY, TIER_NONE, Status
from ascend_store.backends.guard import GuardedBackend
from ascend_store.backends.local.disk import SUFFIX, file_name
from ascend_store.scheduler.lookups import LookupState
from tests.unit.test_local_pool import Pool, _get, _pattern, _put
from tests.unit.test_lookups import KS, _lookups, _no_tails, _store, _until_answered

KiB = 2**10
OBJ = 100 * KiB  # ten of them fill the 1 MiB arena


def _key(i: int) -> str:
    return f"ns/g0/tp0of1/L0-3/{i:032x}"


@pytest.fixture
def disk_pool(sockdir):
    pools = []

    def start(disk_capacity: str = "4MiB") -> Pool:
        disk = ("--disk-path", os.path.join(sockdir, "disk"), "--disk-capacity", disk_capacity)
        p = Pool(os.path.join(sockdir, "pool.sock"), capacity="1MiB", extra=disk).start()
        pools.append(p)
        return p

    yield start
    for p in pools:
        p.stop()


def _fill(client, n: int) -> None:
    for i in range(n):
        _put(client, _key(i), _pattern(i, OBJ))


def test_evicted_objects_go_to_disk_and_come_back(disk_pool):
    pool = disk_pool()
    c = pool.client()
    _fill(c, 30)  # three times the memory tier
    st = c.stats()
    assert st["evictions"] >= 20 and st["disk"]["objects"] == st["evictions"], st
    assert st["disk"]["used_bytes"] <= st["disk"]["capacity"]
    assert all(c.exists([_key(i) for i in range(30)]))
    # The oldest object is on disk: a writer cannot reserve it again (never overwritten).
    assert c.reserve([_key(0)], [OBJ])[0].status is Status.EXISTS
    # The oldest objects live only on disk now; a lease promotes them byte-exact, from the arena.
    for i in range(30):
        assert _get(c, _key(i)) == _pattern(i, OBJ), i
    st = c.stats()
    assert st["promoted"] >= 20 and st["gone"] == 0, st
    # Tiers are exclusive: every object is in exactly one of them.
    assert st["objects"] + st["disk"]["objects"] == 30
    assert len({k for k, _, _, _ in c.list("ns/")}) == 30
    c.close()


def test_tiers_says_where_each_object_is_and_a_lease_brings_it_to_memory(disk_pool):
    c = disk_pool().client()
    _fill(c, 30)
    tiers = c.tiers([_key(i) for i in range(30)] + [_key(99)])
    assert tiers[-1] == TIER_NONE and set(tiers[:-1]) == {TIER_MEMORY, TIER_DISK}
    assert tiers[0] == TIER_DISK and tiers[29] == TIER_MEMORY  # the oldest went to disk
    assert c.stats()["disk"]["objects"] == tiers.count(TIER_DISK)
    assert _get(c, _key(0)) == _pattern(0, OBJ)
    assert c.tiers([_key(0)]) == [TIER_MEMORY]
    c.close()


def test_restart_keeps_the_disk_objects(disk_pool):
    pool = disk_pool()
    c = pool.client()
    _fill(c, 25)
    c.close()
    pool.stop()  # a graceful stop writes the memory tier to disk too
    pool = disk_pool()
    c = pool.client()
    st = c.stats()
    assert st["objects"] == 0 and st["disk"]["objects"] == 25, st
    assert all(_get(c, _key(i)) == _pattern(i, OBJ) for i in range(25))
    c.close()


def test_killed_pool_keeps_what_it_had_spilled(disk_pool):
    pool = disk_pool()
    c = pool.client()
    _fill(c, 25)
    spilled = c.stats()["disk"]["objects"]
    c.close()
    pool.kill()  # no flush: only what was already on disk survives
    c = disk_pool().client()
    assert c.stats()["disk"]["objects"] == spilled > 0
    assert sum(_get(c, _key(i)) == _pattern(i, OBJ) for i in range(25)) == spilled
    c.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "header"])
def test_a_damaged_file_is_a_miss(disk_pool, sockdir, damage):
    pool = disk_pool()
    c = pool.client()
    _fill(c, 25)
    c.close()
    pool.stop()
    path = os.path.join(sockdir, "disk", file_name(_key(3)))
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(os.path.getsize(path) - 1000)
        elif damage == "flip":
            f.seek(os.path.getsize(path) - 5000)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
        else:
            f.write(b"garbage!")
    c = disk_pool().client()
    if damage == "flip":  # found when promoted: its CRC32 no longer matches
        assert c.exists([_key(3)]) == [True]
    assert _get(c, _key(3)) is None
    assert c.exists([_key(3)]) == [False] and not os.path.exists(path)
    st = c.stats()
    assert st["disk"]["corrupt" if damage == "flip" else "dropped_at_start"] == 1, st
    assert all(_get(c, _key(i)) == _pattern(i, OBJ) for i in range(25) if i != 3)
    c.close()


def test_disk_capacity_is_respected(disk_pool, sockdir):
    pool = disk_pool(disk_capacity="1MiB")
    c = pool.client()
    _fill(c, 40)
    st = c.stats()
    files = [n for n in os.listdir(os.path.join(sockdir, "disk")) if n.endswith(SUFFIX)]
    on_disk = sum(os.path.getsize(os.path.join(sockdir, "disk", n)) for n in files)
    assert on_disk == st["disk"]["used_bytes"] <= 2**20 and len(files) == st["disk"]["objects"] == 10, st
    # What fell off the disk is gone from the pool (and counted for the clients' caches).
    assert st["disk"]["evictions"] == st["gone"] > 0
    assert sum(c.exists([_key(i) for i in range(40)])) == st["objects"] + len(files)
    c.close()


def test_status_shows_both_tiers_and_one_pool_per_directory(disk_pool, sockdir):
    pool = disk_pool()
    c = pool.client()
    _fill(c, 15)
    c.close()
    cmd = [sys.executable, "-m", "ascend_store.ops.cli", "pool", "status", "--socket", pool.socket]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    st = json.loads(out.stdout)
    assert st["used_bytes"] > 0 and st["disk"]["objects"] == st["spilled"] == 5, st
    other = subprocess.run([sys.executable, "-m", "ascend_store.ops.cli", "pool", "serve", "--socket",
                            os.path.join(sockdir, "b.sock"), "--capacity", "1MiB",
                            "--disk-path", os.path.join(sockdir, "disk")], capture_output=True, text=True)
    assert other.returncode == 2 and "used by another running pool" in other.stderr


def test_an_engine_started_pool_gets_the_configured_disk_tier(sockdir):
    from ascend_store.backends.local.client import LocalBackend
    from ascend_store.common.config import LocalPoolConfig

    disk = os.path.join(sockdir, "edisk")
    cfg = LocalPoolConfig(socket=os.path.join(sockdir, "e.sock"), capacity=2**20, start="auto",
                          disk_path=disk, disk_capacity=3 * 2**20)
    c = LocalBackend(cfg, timeout_s=2.0)  # starts the pool as an engine would (launcher.ensure_pool)
    try:
        _fill(c, 12)
        st = c.stats()["disk"]
        assert st["path"] == disk and st["capacity"] == 3 * 2**20 and st["objects"] >= 2, st
    finally:
        c.close()


def test_lookups_see_each_chunks_tier_and_a_planned_load_brings_it_to_memory(disk_pool):
    """The scheduler's lookups answer with the tier of every chunk (lookups.py); a load the
    planner plans marks its chunks as in memory in the hit cache, including answers that
    reach the cache only at the step's end, so the next request prices them as memory."""
    pool = disk_pool()
    c = pool.client()
    chain = [f"{i:032x}" for i in range(4)]
    _store(c, [KS.key(0, h) for h in chain])
    c.close()
    pool.stop()  # everything goes to disk
    pool = disk_pool()
    guard = GuardedBackend(pool.client(), "test pool tiers")
    lk = _lookups(guard, deadline_s=5.0)  # a busy machine's first answer must not pass for a miss
    try:
        st = LookupState()
        hit = None
        while hit is None:
            hit = lk.lookup(st, chain, 0, 4, _no_tails)
            if hit is None:
                lk.flush()
                time.sleep(0.01)
        assert (hit.chunks, hit.tiers) == (4, (TIER_DISK,) * 4)
        lk.promoted(chain[:2])  # a load of the first two, planned before the step's end
        lk.flush()  # the step's end: the answers reach the cache
        again, _ = _until_answered(lk, [LookupState()], [chain])
        assert again[0].tiers == (TIER_MEMORY, TIER_MEMORY, TIER_DISK, TIER_DISK)
        assert guard.calls["lookup"] == 1  # the cache answered
    finally:
        lk.close()
        guard.close()
