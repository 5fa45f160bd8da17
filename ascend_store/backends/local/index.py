"""The pool's index over its arena: allocation, LRU eviction, reservations and leases.

Pure bookkeeping with no I/O, so it is tested on its own. Objects are either being
written (reserved, invisible to readers) or ready. Leases pin a ready object against
eviction and removal while a reader copies it out. Leases and reservations carry their
client's owner id; one past its TTL is dropped only once ``alive(owner)`` says its client
is gone (clients.py), so a dead client cannot pin memory forever and a slow live one never
has its memory handed to another object while it still copies (clients the pool cannot
check expire by TTL alone). Every ready object that goes (evicted or removed) is counted
in ``gone`` and its digest kept in a ring, so a client's cache can drop exactly what went.
With a disk tier (tiers.py) the ``spill`` hook keeps an eviction victim on disk, and such
an object is not gone. Commits and deletions are logged for KV events (events.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ascend_store.backends.alloc import FreeList, aligned
from ascend_store.backends.base import TIER_MEMORY, TIER_NONE, Status, object_digest
from ascend_store.backends.local.events import MEMORY, REMOVED, STORED, EventLog


@dataclass
class _Obj:
    offset: int
    size: int  # bytes the client asked for
    alloc: int  # bytes taken from the arena
    ready: bool = False
    leases: dict[str, int] = field(default_factory=dict)  # owner -> leases it holds
    deadline: float = 0.0  # reservation deadline, or when the last lease expires
    owner: str = ""  # the writer of a reservation


class PoolIndex:
    def __init__(self, capacity: int, lease_ttl_s: float = 30.0, reserve_ttl_s: float = 60.0,
                 clock=time.monotonic, gone_ring: int = 65536, spill=None, alive=None):
        self.free = FreeList(capacity)
        self.lease_ttl_s = lease_ttl_s
        self.reserve_ttl_s = reserve_ttl_s
        self._clock = clock
        self._objs: dict[str, _Obj] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()  # ready objects, oldest first
        self.counters = {"evictions": 0, "expired_leases": 0, "expired_reservations": 0,
                         "no_space": 0}
        # alive(owner) -> bool: whether a client still runs (clients.py); None: none is checked.
        self.alive = alive or (lambda owner: False)
        self.overdue = {"overdue_leases": 0, "overdue_reservations": 0}  # as of the last reap
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

    def commit(self, keys: list[str], owner: str = "") -> list[Status]:
        out = []
        for key in keys:
            obj = self._objs.get(key)
            # Not another writer's reservation (clients that send no owner are not checked).
            if obj is None or obj.ready or (owner and obj.owner != owner):
                out.append(Status.MISSING)
                continue
            obj.ready = True
            obj.deadline = 0.0
            self.added += 1
            self._lru[key] = None
            self.events.add(STORED, MEMORY, key)
            out.append(Status.OK)
        return out

    def abort(self, keys: list[str], owner: str = "") -> None:
        for key in keys:
            obj = self._objs.get(key)
            if obj is not None and not obj.ready and (not owner or obj.owner == owner):
                self._delete(key)

    # -- reads ----------------------------------------------------------------
    def exists(self, keys: list[str]) -> list[bool]:
        return [(o := self._objs.get(k)) is not None and o.ready for k in keys]

    def tiers(self, keys: list[str]) -> list[int]:
        return [TIER_MEMORY if f else TIER_NONE for f in self.exists(keys)]

    def lease(self, keys: list[str], owner: str = "") -> list[tuple[Status, int, int]]:
        now, out = self._clock(), []
        for key in keys:
            obj = self._objs.get(key)
            if obj is None or not obj.ready:
                out.append((Status.MISSING, 0, 0))
                continue
            obj.leases[owner] = obj.leases.get(owner, 0) + 1
            obj.deadline = now + self.lease_ttl_s
            self._lru.move_to_end(key)
            out.append((Status.OK, obj.offset, obj.size))
        return out

    def release(self, keys: list[str], owner: str = "") -> None:
        for key in keys:
            obj = self._objs.get(key)
            held = 0 if obj is None else obj.leases.get(owner, 0)
            if held > 1:
                obj.leases[owner] = held - 1
            elif held:
                del obj.leases[owner]

    def remove(self, keys: list[str]) -> list[Status]:
        out = []
        for key in keys:
            obj = self._objs.get(key)
            if obj is None:
                out.append(Status.MISSING)
            elif obj.leases:
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
        """Drop the leases and reservations past their TTL whose client is gone; those of
        live clients stay (counted as overdue): their memory is never reused under them."""
        now = self._clock()
        overdue_leases = overdue_reservations = 0
        for key, obj in list(self._objs.items()):
            if not obj.deadline or obj.deadline > now:
                continue
            if obj.ready:
                kept = {o: n for o, n in obj.leases.items() if self.alive(o)}
                self.counters["expired_leases"] += sum(obj.leases.values()) - sum(kept.values())
                obj.leases = kept
                overdue_leases += bool(kept)
                if not kept:
                    obj.deadline = 0.0
            elif self.alive(obj.owner):
                overdue_reservations += 1
            else:
                self.counters["expired_reservations"] += 1
                self._delete(key)
        self.overdue = {"overdue_leases": overdue_leases, "overdue_reservations": overdue_reservations}

    def list(self, prefix: str) -> list[tuple[str, int, bool, int]]:
        return [(k, o.size, o.ready, sum(o.leases.values())) for k, o in self._objs.items()
                if k.startswith(prefix)]

    def stats(self) -> dict:
        return {
            "capacity": self.free.capacity,
            "used_bytes": self.free.capacity - self.free.free_bytes,
            "objects": sum(o.ready for o in self._objs.values()),
            "reserved": sum(not o.ready for o in self._objs.values()),
            "leases": sum(sum(o.leases.values()) for o in self._objs.values()),
            **self.counters,
            **self.overdue,
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
