"""Every backend reports a generation the scheduler's lookup cache can follow.

Runs on the conformance fixtures (tests/backends/conftest.py): the local pool names each
deleted object; Mooncake changes its epoch when the client is set up again after the
service restarted (its master reports no deletions: cached hits live until their TTL,
docs/backends.md). The memcache stand-in keeps no connection a restart could break, so
it shows only that a generation exists once the client is set up.
"""

from __future__ import annotations

import time

from ascend_store.backends.base import BackendUnavailable, Status, object_digest
from ascend_store.scheduler.hit_cache import BlockHitCache


def _put(b, key: str, size: int = 100) -> None:
    _, view = b.buffer()
    [slot] = b.reserve([key], [size])
    assert slot.status is Status.OK
    view[slot.offset:slot.offset + size] = bytes(size)
    assert b.commit([key]) == [Status.OK]


def test_generation_follows_deletions_and_restarts(service):
    writer, sched = service.backend(), service.backend(role="scheduler")
    try:
        assert sched.generation() is None  # nothing known before the first reply
        _put(writer, "ns/g0/L0/aa")
        _put(writer, "ns/g0/L0/bb")
        assert sched.exists(["ns/g0/L0/aa", "ns/g0/L0/bb"]) == [True, True]
        g1 = sched.generation()
        assert g1 is not None
        cache = BlockHitCache()
        cache.observe(g1)
        cache.put("aa", True)
        cache.put("bb", True)
        if service.kind == "local":  # another client (another engine's worker) removes one chunk
            assert writer.remove(["ns/g0/L0/aa"]) == [Status.OK]
            sched.exists(["ns/g0/L0/bb"])
            cache.observe(g2 := sched.generation())
            assert g2.gone == g1.gone + 1 and list(g2.recent[-1:]) == [object_digest("x/aa")]
            assert (cache.get("aa"), cache.get("bb")) == (None, True)  # only that chunk's hit went
        else:  # these stores report no deletions: the generation holds still, hits live to their TTL
            sched.exists(["ns/g0/L0/bb"])
            assert sched.generation() == g1
        if service.kind == "memcache":
            return
        service.restart()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                sched.exists(["ns/g0/L0/bb"])
                if sched.generation().epoch != g1.epoch:
                    break
            except BackendUnavailable:
                pass
            time.sleep(0.5)
        cache.observe(sched.generation())
        assert sched.generation().epoch != g1.epoch and len(cache) == 0  # a restart drops everything
    finally:
        writer.close()
        sched.close()
