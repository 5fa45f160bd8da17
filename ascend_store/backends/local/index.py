"""The pool's index over its arena: allocation, LRU eviction, reservations and leases.

Pure bookkeeping with no I/O, so it is tested on its own. Objects are either being
written (reserved, invisible to readers, freed if not committed in time) or ready.
Leases pin a ready object against eviction and removal while a reader copies it out;
a lease that is not released within its TTL is dropped, so a dead client cannot pin
memory forever. Every ready object that goes (evicted or removed) is counted in ``gone``
and its digest kept in a ring, so a client's cache can drop exactly what went. With a disk
tier (tiers.py) the ``spill`` hook keeps an eviction victim on disk, and such an object is
not gone. Commits and deletions are logged for KV events (events.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ascend_store.backends.alloc import FreeList, aligned
from ascend_store.backends.base import Status, object_digest
from ascend_store.backends.local.events import MEMORY, REMOVED, STORED, EventLog


@dataclass
class _Obj:
    offset: int
    size: int  # bytes the client asked for
    alloc: int  # bytes taken from the arena
    ready: bool = False
    leases: int = 0
    deadline: float = 0.0  # reservation deadline, or when the last lease expires
    owner: str = ""  # the writer of a reservation


class PoolIndex:
    def __init__(self, capacity: int, lease_ttl_s: float = 30.0, reserve_ttl_s: float = 60.0,
                 clock=time.monotonic, gone_ring: int = 65536, spill=None):
        self.free = FreeList(capacity)
        self.lease_ttl_s = lease_ttl_s
        self.reserve_ttl_s = reserve_ttl_s
        self._clock = clock
        self._objs: dict[str, _Obj] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # ready objects, oldest first
        self.counters = {"evictions": 0, "expired_leases": 0, "expired_reservations": 0,
                         "no_space": 0}
        self.gone = 0  # ready objects deleted so far
        self.added = 0  # objects committed so far (clients' cached misses end when it moves)
        self._gone_ring = np.zeros(gone_ring, dtype="<u8")  # their digests, by gone % size
        self.events = EventLog()
        # spill(key, offset, size) -> bool: keeps an evicted object elsewhere (the disk tier);
        # a kept object is not gone, so clients' lookup caches keep its hit.
        self.spill = spill

    # -- writes ---------------------------------------------------------------
    def reserve(self, keys: list[str], sizes: list[int], owner: str = "") -> list[tuple[Status, int]]:
        """Reserve space to write; a writer may re-reserve its own uncommitted object (its
        earlier commit was lost), anyone else gets EXISTS for an object being written."""
        now, out = self._clock(), []
        for key, size in zip(keys, sizes):
            obj = self._objs.get(key)
            if obj is not None:
                if owner and obj.owner == owner and not obj.ready and obj.size == size:
                    obj.deadline = now + self.reserve_ttl_s
                    out.append((Status.OK, obj.offset))
                else:
                    out.append((Status.EXISTS, 0))
                continue
            need = aligned(size)
            off = self._alloc(need)
            if off is None:
                self.counters["no_space"] += 1
                out.append((Status.NO_SPACE, 0))
                continue
            self._objs[key] = _Obj(off, size, need, deadline=now + self.reserve_ttl_s, owner=owner)
            out.append((Status.OK, off))
        return out

    def commit(self, keys: list[str]) -> list[Status]:
        out = []
        for key in keys:
            obj = self._objs.get(key)
            if obj is None or obj.ready:
                out.append(Status.MISSING)
                continue
            obj.ready = True
            obj.deadline = 0.0
            self.added += 1
            self._lru[key] = None
            self.events.add(STORED, MEMORY, key)
            out.append(Status.OK)
        return out

    def abort(self, keys: list[str]) -> None:
        for key in keys:
            obj = self._objs.get(key)
            if obj is not None and not obj.ready:
                self._delete(key)

    # -- reads ----------------------------------------------------------------
    def exists(self, keys: list[str]) -> list[bool]:
        return [(o := self._objs.get(k)) is not None and o.ready for k in keys]

    def lease(self, keys: list[str]) -> list[tuple[Status, int, int]]:
        now, out = self._clock(), []
        for key in keys:
            obj = self._objs.get(key)
            if obj is None or not obj.ready:
                out.append((Status.MISSING, 0, 0))
                continue
            obj.leases += 1
            obj.deadline = now + self.lease_ttl_s
            self._lru.move_to_end(key)
            out.append((Status.OK, obj.offset, obj.size))
        return out

    def release(self, keys: list[str]) -> None:
        for key in keys:
            obj = self._objs.get(key)
            if obj is not None and obj.leases > 0:
                obj.leases -= 1

    def remove(self, keys: list[str]) -> list[Status]:
        out = []
        for key in keys:
            obj = self._objs.get(key)
            if obj is None:
                out.append(Status.MISSING)
            elif obj.leases > 0:
                out.append(Status.BUSY)
            else:
                self._delete(key)
                out.append(Status.OK)
        return out

    def gone_since(self, since: int) -> bytes | None:
        """Digests of the objects deleted after the first ``since``, oldest first; None when
        the ring no longer holds them all (or ``since`` is from another epoch)."""
        ring = self._gone_ring
        if since > self.gone or self.gone - since > len(ring):
            return None
        return ring[np.arange(since, self.gone) % len(ring)].tobytes()

    # -- upkeep ---------------------------------------------------------------
    def reap(self) -> None:
        """Drop expired leases and reservations whose writer never committed."""
        now = self._clock()
        for key, obj in list(self._objs.items()):
            if not obj.deadline or obj.deadline > now:
                continue
            if obj.ready:
                self.counters["expired_leases"] += obj.leases
                obj.leases, obj.deadline = 0, 0.0
            else:
                self.counters["expired_reservations"] += 1
                self._delete(key)

    def list(self, prefix: str) -> list[tuple[str, int, bool, int]]:
        return [(k, o.size, o.ready, o.leases) for k, o in self._objs.items() if k.startswith(prefix)]

    def stats(self) -> dict:
        return {
            "capacity": self.free.capacity,
            "used_bytes": self.free.capacity - self.free.free_bytes,
            "objects": sum(o.ready for o in self._objs.values()),
            "reserved": sum(not o.ready for o in self._objs.values()),
            "leases": sum(o.leases for o in self._objs.values()),
            **self.counters,
        }

    def _alloc(self, need: int) -> int | None:
        if need > self.free.capacity:
            return None
        off = self.free.alloc(need)
        if off is not None:
            return off
        # Evict least recently used, unleased objects until one free segment fits. Each
        # victim is found from the LRU end (copying the whole LRU made every eviction cost
        # O(objects): 1.3 ms each with 50K objects, benchmarks/pool_index.py).
        while True:
            victim = next((k for k in self._lru if not self._objs[k].leases), None)
            if victim is None:
                return None
            self.counters["evictions"] += 1
            obj = self._objs[victim]
            kept = self.spill is not None and self.spill(victim, obj.offset, obj.size)
            if self._delete(victim, gone=not kept) >= need:
                return self.free.alloc(need)

    def note_gone(self, key: str) -> None:
        """Count a ready object as deleted from the pool (every tier)."""
        self._gone_ring[self.gone % len(self._gone_ring)] = object_digest(key)
        self.gone += 1

    def ready_slots(self) -> list[tuple[str, int, int]]:
        """(key, offset, size) of the ready objects, least recently used first."""
        return [(k, self._objs[k].offset, self._objs[k].size) for k in self._lru]

    def _delete(self, key: str, gone: bool = True) -> int:
        obj = self._objs.pop(key)
        if obj.ready:
            self._lru.pop(key, None)
            self.events.add(REMOVED, MEMORY, key)
            if gone:
                self.note_gone(key)
        return self.free.free(obj.offset, obj.alloc)
