"""Scheduler-side cache of pool lookups, per (namespace, group, chain hash).

Under prefix-sharing load many requests ask about the same chunks within seconds. The
cache remembers each chunk's answer (every layer and shard present: hit; otherwise
miss) for ``ttl_s``, bounded to ``max_entries`` (oldest dropped first). It is invalidated
- per chunk when we plan to save it (a cached miss must not hide the new object) and
  when a worker reports it missing or corrupt on load;
- for every cached hit when the pool reports more evictions than last seen;
- entirely when the pool restarts (its epoch changes).
A stale hit can still happen between an eviction and the next reply; it ends in the
worker's load-error path and vLLM recomputes, so it costs time, never tokens.
"""

from __future__ import annotations

import time
from collections import OrderedDict


class BlockHitCache:
    def __init__(self, ttl_s: float = 30.0, max_entries: int = 200_000, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[bool, float]] = OrderedDict()  # key -> (hit, expiry)
        self._generation: tuple[str, int] | None = None
        self.counters = {"cache_hits": 0, "cache_misses": 0, "invalidations": 0}

    def get(self, key: str) -> bool | None:
        entry = self._entries.get(key)
        if entry is None or entry[1] <= self._clock():
            if entry is not None:
                del self._entries[key]
            self.counters["cache_misses"] += 1
            return None
        self.counters["cache_hits"] += 1
        return entry[0]

    def put(self, key: str, hit: bool) -> None:
        self._entries.pop(key, None)
        self._entries[key] = (hit, self._clock() + self.ttl_s)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def invalidate(self, keys) -> None:
        for key in keys:
            if self._entries.pop(key, None) is not None:
                self.counters["invalidations"] += 1

    def observe(self, generation: tuple[str, int] | None) -> None:
        """Feed the pool's (epoch, evictions) as last seen; drop what they make stale."""
        if generation is None or generation == self._generation:
            return
        old, self._generation = self._generation, generation
        if old is None:
            return
        if old[0] != generation[0]:
            self.counters["invalidations"] += len(self._entries)
            self._entries.clear()
        else:  # evictions grew: any cached hit may be gone
            stale = [k for k, (hit, _) in self._entries.items() if hit]
            self.invalidate(stale)

    def __len__(self) -> int:
        return len(self._entries)
