"""The scheduler's KV event feed (kv_events.py) against a real pool process with a disk tier:
the pool's event log becomes vLLM's BlockStored / BlockRemoved with the tier as medium.
About 10 s (a pool process per test; importing vLLM's event types is most of it)."""

from __future__ import annotations

import os

from ascend_store.backends.local.events import EventLog
from ascend_store.keys import KeySpace
from ascend_store.kv_events import KVEventFeed
from tests.unit.test_local_pool import Pool, _get, _pattern, _put

NS = "ns"


def _key(i: int, tp: int = 0, group: int = 0) -> str:
    return KeySpace(NS, f"tp{tp}of2", "pp0of1").key(group, f"{i:032x}")


def _tally(events) -> dict:
    out = {}
    for ev in events:
        out.setdefault((type(ev).__name__, ev.medium, ev.group_idx), []).extend(ev.block_hashes)
    return out


def test_feed_reports_stores_spills_promotions_and_drops(sockdir):
    pool = Pool(os.path.join(sockdir, "pool.sock"), capacity="1MiB",
                extra=("--disk-path", os.path.join(sockdir, "disk"), "--disk-capacity", "1MiB")).start()
    try:
        c = pool.client()
        feed = KVEventFeed(c, KeySpace(NS, "tp0of2"), chunk_tokens=256)
        size = 100 * 2**10
        for i in range(12):
            _put(c, _key(i), _pattern(i, size))
        _put(c, _key(0, tp=1), b"x" * 512)  # another shard of chunk 0: not reported twice
        _put(c, _key(1, group=1), b"y" * 512)  # another KV cache group: its own events
        _put(c, KeySpace("other", "tp0of2").key(0, f"{5:032x}"), b"z" * 512)  # another model's namespace
        t = _tally(feed.take())
        assert t[("BlockStored", "CPU", 0)] == list(range(12))
        assert t[("BlockStored", "CPU", 1)] == [1]
        assert t[("BlockRemoved", "CPU", 0)] == t[("BlockStored", "DISK", 0)] == [0, 1]  # spilled
        assert feed.take() == []  # nothing new: nothing reported twice
        assert _get(c, _key(0)) == _pattern(0, size)  # promoted: disk -> memory
        t = _tally(feed.take())
        assert t[("BlockRemoved", "DISK", 0)] == [0] and t[("BlockStored", "CPU", 0)] == [0]
        assert feed.take() == []
        st = c.stats()["events"]
        assert st["stored_cpu"] == 12 + 3 + 1 and st["removed_disk"] == 1
        c.close()
    finally:
        pool.stop()


def test_event_log_reports_what_a_slow_reader_lost():
    log = EventLog(size=4)
    for i in range(6):
        log.add(0, 0, f"k{i}")
    got = log.since(0)
    assert got["lost"] == 2 and got["event_keys"] == ["k2", "k3", "k4", "k5"] and got["cursor"] == 6
    assert log.since(6)["event_keys"] == [] and log.since(99)["lost"] == 2  # another epoch's cursor


def test_feed_follows_a_restarted_pool(sockdir):
    """After a restart the feed reads the new log from its start: what the pool found on disk."""
    disk = ("--disk-path", os.path.join(sockdir, "disk"), "--disk-capacity", "4MiB")
    pool = Pool(os.path.join(sockdir, "pool.sock"), capacity="1MiB", extra=disk).start()
    try:
        c = pool.client()
        feed = KVEventFeed(c, KeySpace(NS, "tp0of2"), chunk_tokens=256)
        for i in range(3):
            _put(c, _key(i), b"k" * 1024)
        assert _tally(feed.take())[("BlockStored", "CPU", 0)] == [0, 1, 2]
        pool.stop()  # writes the memory tier to disk
        pool.start()
        assert _tally(feed.take()) == {("BlockStored", "DISK", 0): [0, 1, 2]}
        c.close()
    finally:
        pool.stop()
