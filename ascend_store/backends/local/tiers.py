"""Memory and disk tiers behind the index's interface: what the pool server uses when it has a disk tier.

The memory tier (index.py) evicts least recently used objects; with a disk tier its
``spill`` hook writes each victim's bytes from the arena to disk first, so the object stays
readable. A lease of an object on disk promotes it: space is reserved in the arena (which
may spill others), the file is read into it and checked, and the object is committed to
memory and leased like any other, so readers always copy from the arena (the lease
protocol is unchanged). A file that fails its check is a miss and is removed. Tiers are
exclusive (disk.py); an object is *gone* for clients' lookup caches only when it leaves the
last tier. On a graceful stop the memory tier is written to disk, so a restarted pool
starts with everything it held.
"""

from __future__ import annotations

import logging

from ascend_store.backends.base import TIER_DISK, TIER_MEMORY, TIER_NONE, Status
from ascend_store.backends.local.disk import DiskTier
from ascend_store.backends.local.events import DISK, REMOVED, STORED
from ascend_store.backends.local.index import PoolIndex

log = logging.getLogger("ascend_store.pool")


class TieredIndex:
    def __init__(self, capacity: int, arena: memoryview, disk: DiskTier, lease_ttl_s: float = 30.0,
                 alive=None):
        self.mem = PoolIndex(capacity, lease_ttl_s=lease_ttl_s, spill=self._spill, alive=alive)
        self.disk = disk
        self.events = self.mem.events
        self._arena = arena
        self.counters = {"spilled": 0, "promoted": 0, "promote_failed": 0}
        for key, _ in disk.keys():  # what a restarted pool still holds, for KV event readers
            self.events.add(STORED, DISK, key)

    @property
    def gone(self) -> int:
        return self.mem.gone

    @property
    def added(self) -> int:
        return self.mem.added

    def gone_since(self, since: int) -> bytes | None:
        return self.mem.gone_since(since)

    def _spill(self, key: str, offset: int, size: int) -> bool:
        stored, evicted = self.disk.put(key, self._arena[offset:offset + size])
        for k in evicted:
            self._gone_from_disk(k)
        if stored:
            self.counters["spilled"] += 1
            self.events.add(STORED, DISK, key)
        return stored

    def _gone_from_disk(self, key: str) -> None:
        self.events.add(REMOVED, DISK, key)
        self.mem.note_gone(key)

    # -- the index's interface ---------------------------------------------------
    def exists(self, keys: list[str]) -> list[bool]:
        return [t != TIER_NONE for t in self.tiers(keys)]

    def tiers(self, keys: list[str]) -> list[int]:
        disk = self.disk
        return [TIER_MEMORY if m else TIER_DISK if k in disk else TIER_NONE
                for k, m in zip(keys, self.mem.exists(keys))]

    def reserve(self, keys: list[str], sizes: list[int], owner: str = "") -> list[tuple[Status, int]]:
        on_disk = [k in self.disk for k in keys]
        if not any(on_disk):
            return self.mem.reserve(keys, sizes, owner=owner)
        todo = [(k, s) for k, s, d in zip(keys, sizes, on_disk) if not d]
        got = iter(self.mem.reserve([k for k, _ in todo], [s for _, s in todo], owner=owner))
        return [(Status.EXISTS, 0) if d else next(got) for d in on_disk]

    def commit(self, keys: list[str], owner: str = "") -> list[Status]:
        return self.mem.commit(keys, owner)

    def abort(self, keys: list[str], owner: str = "") -> None:
        self.mem.abort(keys, owner)

    def lease(self, keys: list[str], owner: str = "") -> list[tuple[Status, int, int]]:
        # Memory hits are leased (pinned) first, so promoting the rest cannot spill them.
        out = self.mem.lease(keys, owner)
        for i, key in enumerate(keys):
            if out[i][0] == Status.MISSING and key in self.disk:
                out[i] = self._promote(key, owner)
        return out

    def _promote(self, key: str, owner: str) -> tuple[Status, int, int]:
        size = self.disk.size(key)
        status, offset = self.mem.reserve([key], [size])[0]
        if status != Status.OK:  # the arena is full of leased objects: try again later
            self.counters["promote_failed"] += 1
            return Status.MISSING, 0, 0
        ok = self.disk.read_into(key, self._arena[offset:offset + size])
        self.disk.remove(key)
        if not ok:
            self.mem.abort([key])
            self._gone_from_disk(key)
            return Status.MISSING, 0, 0
        self.events.add(REMOVED, DISK, key)
        self.mem.commit([key])
        self.counters["promoted"] += 1
        return self.mem.lease([key], owner)[0]

    def release(self, keys: list[str], owner: str = "") -> None:
        self.mem.release(keys, owner)

    def remove(self, keys: list[str]) -> list[Status]:
        out = self.mem.remove(keys)
        for i, key in enumerate(keys):
            if out[i] == Status.MISSING and key in self.disk:
                self.disk.remove(key)
                self._gone_from_disk(key)
                out[i] = Status.OK
        return out

    def reap(self) -> None:
        self.mem.reap()

    def list(self, prefix: str) -> list[tuple[str, int, bool, int]]:
        return self.mem.list(prefix) + [(k, n, True, 0) for k, n in self.disk.keys(prefix)]

    def stats(self) -> dict:
        return {**self.mem.stats(), **self.counters, "disk": self.disk.stats()}

    def flush(self) -> int:
        """Write every ready object in memory to disk (oldest first, so the disk keeps the
        LRU order); return how many were written."""
        slots = self.mem.ready_slots()
        written = sum(self._spill(k, off, n) for k, off, n in slots)
        log.info("wrote %d of %d objects in memory to the disk tier before stopping", written, len(slots))
        return written

    def close(self) -> None:
        self.disk.close()
