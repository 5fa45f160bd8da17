"""The scheduler's KV event feed (kv_events.py) against a real pool process: the objects
whose saves were planned for a real vLLM ``Request`` become vLLM's BlockStored /
BlockRemoved under vLLM's block hashes, as they enter and leave the pool's tiers (its
event log), or, for a store without a log (Mooncake, memcache), as ``exists`` finds them.
About 10 s (a pool process per test; importing vLLM is most of it)."""

from __future__ import annotations

import os

import pytest

from ascend_store.backends.base import Backend
from ascend_store.backends.local.client import LocalBackend
from ascend_store.backends.local.events import EventLog
from ascend_store.common.keys import KeySpace
from ascend_store.scheduler import kv_events
from ascend_store.scheduler.kv_events import KVEventFeed
from tests.unit.test_local_pool import Pool, _get, _pattern, _put

NS = "ns"
BS, CHUNK = 16, 32  # vLLM's block, the pool's object: two blocks each
SHARDS = [KeySpace(NS, "tp0of2"), KeySpace(NS, "tp1of2")]


def _key(i: int, tp: int = 0, group: int = 0) -> str:
    return SHARDS[tp].key(group, f"{i:032x}")


def _request(n_tokens: int):
    """A real vLLM request, hashed as the engine hashes it (sha256, one hash per block)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    tokens = [(7 * i) % 500 + 2 for i in range(n_tokens)]
    req = Request("r0", tokens, SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(BS, sha256))
    return req, [maybe_convert_block_hash(h) for h in req.block_hashes]


def _feed(backend, n_objects: int, groups=(0,)):
    """A feed with objects 0..n-1 (chunk i: tokens [32i, 32i+32)) of a 16-chunk request planned."""
    feed = KVEventFeed(backend, SHARDS, list(groups), BS, None)
    req, vh = _request(16 * CHUNK + 5)
    feed.planned(req, [(f"{i:032x}", i * CHUNK, (i + 1) * CHUNK) for i in range(n_objects)])
    return feed, req, vh


def _events(feed) -> list:
    feed.fetch()
    return feed.take()


def _tally(events) -> dict:
    out = {}
    for ev in events:
        out.setdefault((type(ev).__name__, ev.medium, ev.group_idx), []).extend(ev.block_hashes)
    return out


def _blocks(vh, *objects) -> list:
    return [h for i in objects for h in vh[2 * i:2 * i + 2]]


def test_feed_reports_vllm_block_hashes_through_the_tiers(sockdir):
    pool = Pool(os.path.join(sockdir, "pool.sock"), capacity="1MiB",
                extra=("--disk-path", os.path.join(sockdir, "disk"), "--disk-capacity", "1MiB")).start()
    try:
        c = pool.client()
        feed, req, vh = _feed(c, 12, groups=(0, 1))
        size = 100 * 2**10
        for i in range(12):
            _put(c, _key(i), _pattern(i, size))
        _put(c, _key(0, tp=1), b"x" * 512)  # another shard of object 0: not reported twice
        _put(c, _key(1, group=1), b"y" * 512)  # another KV cache group: its own events
        _put(c, _key(12), b"w" * 512)  # not planned here (another engine's): not reported
        _put(c, KeySpace("other", "tp0of2").key(0, f"{5:032x}"), b"z" * 512)  # another model's
        events = _events(feed)
        stored = [ev for ev in events if type(ev).__name__ == "BlockStored" and ev.group_idx == 0
                  and ev.medium == "CPU"]
        assert len(stored) == 12
        for i, ev in enumerate(stored):  # each object's blocks, chained to the block before it
            assert (ev.block_hashes, ev.parent_block_hash) == (_blocks(vh, i), vh[2 * i - 1] if i else None)
            assert ev.token_ids == list(req.all_token_ids[i * CHUNK:(i + 1) * CHUNK])
            assert (ev.block_size, ev.lora_name, ev.extra_keys) == (BS, None, [None, None])
        t = _tally(events)
        assert t[("BlockStored", "CPU", 1)] == _blocks(vh, 1)
        spilled = _blocks(vh, 0, 1)
        assert t[("BlockRemoved", "CPU", 0)] == t[("BlockStored", "STORAGE", 0)] == spilled
        assert _events(feed) == []  # nothing new: nothing reported twice
        assert _get(c, _key(0)) == _pattern(0, size)  # promoted: disk -> memory
        t = _tally(_events(feed))
        assert t[("BlockRemoved", "STORAGE", 0)] == t[("BlockStored", "CPU", 0)] == _blocks(vh, 0)
        assert c.stats()["events"]["stored_cpu"] == 12 + 4 + 1  # the pool's own count
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
    """The memory tier of a stopped pool is gone (reported removed); what the restarted pool
    found on disk is reported stored there."""
    disk = ("--disk-path", os.path.join(sockdir, "disk"), "--disk-capacity", "4MiB")
    pool = Pool(os.path.join(sockdir, "pool.sock"), capacity="1MiB", extra=disk).start()
    try:
        c = pool.client()
        feed, _, vh = _feed(c, 3)
        for i in range(3):
            _put(c, _key(i), b"k" * 1024)
        assert _tally(_events(feed)) == {("BlockStored", "CPU", 0): _blocks(vh, 0, 1, 2)}
        pool.stop()  # writes the memory tier to disk
        pool.start()
        assert _tally(_events(feed)) == {("BlockRemoved", "CPU", 0): _blocks(vh, 0, 1, 2),
                                         ("BlockStored", "STORAGE", 0): _blocks(vh, 0, 1, 2)}
        c.close()
    finally:
        pool.stop()


class _NoLog(LocalBackend):
    """The local pool as a store that keeps no event log looks to the feed (Mooncake, memcache)."""

    events = Backend.events


def test_feed_without_a_log_asks_whether_planned_objects_are_there(pool, monkeypatch):
    # Room for 3 objects (their tokens, hashes and the rest): object 0 drops out when 3 is planned.
    monkeypatch.setattr(kv_events, "TRACKED_BYTES", 3 * (4 * CHUNK + 8 * 2 + kv_events.OBJECT_BYTES))
    c = _NoLog(pool.cfg(), timeout_s=1.0)
    try:
        feed, req, vh = _feed(c, 3)
        assert _events(feed) == [] and feed.has_log is False  # asked: none there yet
        _put(c, _key(1), b"a" * 512)
        assert _events(feed) == []  # one shard of two: not loadable yet
        _put(c, _key(1, tp=1), b"a" * 512)
        [ev] = _events(feed)
        assert (type(ev).__name__, ev.block_hashes, ev.parent_block_hash) == ("BlockStored", vh[2:4], vh[1])
        assert ev.token_ids == list(req.all_token_ids[CHUNK:2 * CHUNK])
        feed.planned(req, [(f"{3:032x}", 3 * CHUNK, 4 * CHUNK)])
        for i in (0, 2, 3):
            _put(c, _key(i), b"b" * 512)
            _put(c, _key(i, tp=1), b"b" * 512)
        assert _tally(_events(feed)) == {("BlockStored", "CPU", 0): _blocks(vh, 2, 3)}  # not the dropped 0
        rpcs = c.rpcs
        assert _events(feed) == [] and c.rpcs == rpcs  # nothing in question: no call
        feed.failed([f"{1:032x}", f"{2:032x}"])  # loads failed: asked again
        c.remove([_key(2, tp=1)])
        rpcs = c.rpcs
        assert _tally(_events(feed)) == {("BlockRemoved", "CPU", 0): _blocks(vh, 2)}  # 1 is still there
        assert c.rpcs == rpcs + 1  # one exists for both
    finally:
        c.close()


@pytest.mark.parametrize("lora", [False, True])
def test_stored_events_carry_vllm_extra_keys(pool, lora):
    """LoRA and cache_salt: vLLM's event fields, as its own KV cache manager fills them."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    req = Request("r1", list(range(2, 2 + 2 * CHUNK)), SamplingParams(max_tokens=1), None,
                  lora_request=LoRARequest("ad", 3, "/none") if lora else None, cache_salt="s1",
                  block_hasher=get_request_block_hasher(BS, sha256))
    c = pool.client()
    try:
        feed = KVEventFeed(c, SHARDS, [0], BS, None)
        feed.planned(req, [(f"{i:032x}", i * CHUNK, (i + 1) * CHUNK) for i in range(2)])
        for i in range(2):
            _put(c, _key(i), b"c" * 512)
        first, second = _events(feed)
        name = ("ad",) if lora else ()
        assert first.extra_keys == [name + ("s1",), name or None] and second.extra_keys == [name or None] * 2
        assert (first.lora_name, first.lora_id) == (("ad", 3) if lora else (None, None))
    finally:
        c.close()
