"""Scheduler-side cache of pool lookups, per (namespace, group, chain hash).

Under prefix-sharing load many requests ask about the same chunks within seconds. The
cache remembers each chunk's answer (every layer and shard present: hit, as the tier that
holds it; otherwise miss) for ``ttl_s``, bounded to ``max_entries`` (oldest dropped
first). It is invalidated
- per chunk when we plan to save it (a cached miss must not hide the new object) and
  when a worker reports it missing or corrupt on load;
- every cached miss once the pool reports a commit after it (``Generation.added``): another
  engine may have stored the chunk (a backend that does not report commits keeps misses
  for ``ttl_s``);
- per chunk when the pool reports that one of the chunk's objects went (evicted or
  removed: ``Generation.recent`` names them by ``object_digest`` of the chain hash);
  every cached hit when the pool reports more gone objects than it names (a backend
  that cannot name them, or a cache that lagged too far);
- entirely when the pool restarts (its epoch changes).
A stale hit can still happen between a deletion and the next reply; it ends in the
worker's load-error path and vLLM recomputes, so it costs time, never tokens. A hit's tier
goes stale as the pool moves objects between tiers; that only misprices a load.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from ascend_store.backends.base import Generation, object_digest


class BlockHitCache:
    def __init__(self, ttl_s: float = 30.0, max_entries: int = 200_000, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        # key -> (hit, expiry, object_digest of the key for hits / the pool's commit count for misses)
        self._entries: OrderedDict[str, tuple[int, float, int]] = OrderedDict()
        self._hits_by_digest: dict[int, set[str]] = {}  # cached hits by their objects' digest
        self._generation: tuple[str, int] | None = None
        self._added: int | None = None  # the pool's commit count, as last seen
        self.counters = {"cache_hits": 0, "cache_misses": 0, "invalidations": 0}

    def get(self, key: str) -> int | None:
        """The cached answer: None (not cached), a falsy miss, or the hit's tier."""
        entry = self._entries.get(key)
        if entry is None or entry[1] <= self._clock() or (not entry[0] and entry[2] != (self._added or 0)):
            if entry is not None:
                self._pop(key)
            self.counters["cache_misses"] += 1
            return None
        self.counters["cache_hits"] += 1
        return entry[0]

    def put(self, key: str, hit: int) -> None:
        self._pop(key)
        digest = object_digest(key) if hit else (self._added or 0)
        self._entries[key] = (hit, self._clock() + self.ttl_s, digest)
        if hit:
            self._hits_by_digest.setdefault(digest, set()).add(key)
        while len(self._entries) > self.max_entries:
            self._pop(next(iter(self._entries)))

    def promote(self, keys, tier: int = 1) -> None:
        """Cached hits are now in ``tier`` (a lease brought them into the pool's memory)."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry[0]:
                self._entries[key] = (tier, *entry[1:])

    def invalidate(self, keys) -> None:
        for key in keys:
            if self._pop(key):
                self.counters["invalidations"] += 1

    def _pop(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        if entry[0]:
            same = self._hits_by_digest.get(entry[2])
            if same is not None:
                same.discard(key)
                if not same:
                    del self._hits_by_digest[entry[2]]
        return True

    def observe(self, generation: Generation | tuple | None) -> None:
        """Feed the pool's ``Generation`` as last seen; drop what it makes stale."""
        if generation is not None and len(generation) > 3:
            self._added = generation[3]
        if generation is None or tuple(generation[:2]) == self._generation:
            return
        old, self._generation = self._generation, tuple(generation[:2])
        if old is None:
            return
        if old[0] != generation[0]:
            self.counters["invalidations"] += len(self._entries)
            self._entries.clear()
            self._hits_by_digest.clear()
            return
        went = generation[1] - old[1]
        recent = generation[2] if len(generation) > 2 else None
        if recent is None or went > len(recent) or went < 0:  # cannot tell which: any hit may be gone
            self.invalidate([k for k, (hit, _, _) in self._entries.items() if hit])
            return
        for digest in np.unique(recent[len(recent) - went:]).tolist():
            self.invalidate(list(self._hits_by_digest.get(digest, ())))

    def __len__(self) -> int:
        return len(self._entries)
