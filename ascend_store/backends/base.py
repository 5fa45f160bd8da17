"""The backend interface every pool implementation provides.

Data moves through host memory the backend owns and exposes as ``buffer()``: the
embedded pool hands out its shared-memory arena itself (zero extra copies); a remote
store hands out a registered staging buffer and moves bytes on commit / lease.

Writes are two-phase: ``reserve`` returns slots to fill, ``commit`` publishes them,
``abort`` drops them. Reads are leases: ``lease`` pins objects and returns their slots,
``release`` unpins. Every call is bounded by the backend's timeout and raises
``BackendUnavailable`` when the service cannot be reached in time; per-key outcomes
come back as ``Status`` values.
"""

from __future__ import annotations

import enum
import hashlib
from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np


class Status(enum.IntEnum):
    OK = 0
    MISSING = 1  # no such (readable) object
    EXISTS = 2  # reserve: already stored, nothing to write
    NO_SPACE = 3  # reserve: nothing evictable frees enough room
    INVALID = 4  # malformed key or size
    BUSY = 5  # remove: the object is leased by a reader


# Where an object is, as ``Backend.tiers`` answers: the load planner prices each tier apart.
TIER_NONE = 0  # not stored
TIER_MEMORY = 1  # the backend's memory (Mooncake's and memcache's whole store)
TIER_DISK = 2  # the embedded pool's disk tier
TIERS = 2


class BackendUnavailable(RuntimeError):
    """The service did not answer within the timeout, or is not running."""


class Slot(NamedTuple):  # a tuple: a 32K-token hit builds thousands of them per step
    status: Status
    offset: int = 0
    size: int = 0


STATUSES = tuple(Status)  # Status by value, faster than Status(value)


class Slots(NamedTuple):
    """A call's slots as int64 arrays, one entry per key asked: what the worker's hot path
    reads, with no object per key (the local pool sends them packed)."""

    status: np.ndarray  # Status values
    offset: np.ndarray
    size: np.ndarray

    @classmethod
    def of(cls, slots: list[Slot]) -> "Slots":
        a = np.asarray([tuple(s) for s in slots], dtype=np.int64).reshape(-1, 3)
        return cls(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy())

    def to_list(self) -> list[Slot]:
        return [Slot(STATUSES[s], o, n) for s, o, n in zip(self.status.tolist(), self.offset.tolist(),
                                                          self.size.tolist())]


class Generation(NamedTuple):
    """What a backend knows about its store's changes, for caches of its answers.

    ``epoch`` changes when the store restarts (everything is gone). ``gone`` counts the
    objects deleted since (evicted or removed). ``recent`` holds ``object_digest`` of the
    last ``len(recent)`` of them, oldest first: a cache that last saw ``g`` can drop just
    the entries of ``recent[-(gone - g):]``, and must drop every cached hit when
    ``gone - g`` exceeds ``len(recent)`` (or ``recent`` is None: not reported).
    ``added`` counts the objects committed since the restart (None: not reported): a
    cached miss is void once it moved, since another engine may have stored the chunk."""

    epoch: str
    gone: int = 0
    recent: np.ndarray | None = None
    added: int | None = None


def object_digest(key: str) -> int:
    """64-bit digest of a key's last ``/`` component (the chunk's chain hash): every layer,
    shard and namespace of one chunk share it, so any of them going drops that chunk's
    cached answer (a false drop costs one lookup, never a token)."""
    name = key.rpartition("/")[2].encode()
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")


class Backend(ABC):
    @abstractmethod
    def buffer(self) -> tuple[str, memoryview]:
        """(epoch, host memory that slot offsets index). The epoch changes when the
        service restarts; slots from an older epoch are void."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

    def tiers(self, keys: list[str]) -> list[int]:
        """Per key: TIER_NONE, or the tier that holds it (``exists`` for a store of one tier)."""
        return [TIER_MEMORY if f else TIER_NONE for f in self.exists(keys)]

    @abstractmethod
    def reserve(self, keys: list[str], sizes: list[int]) -> list[Slot]: ...

    @abstractmethod
    def commit(self, keys: list[str]) -> list[Status]: ...

    @abstractmethod
    def abort(self, keys: list[str]) -> None: ...

    @abstractmethod
    def lease(self, keys: list[str], sizes: list[int] | None = None) -> list[Slot]:
        """``sizes``: the largest each object can be (stores that copy into staging
        memory need it; the local pool ignores it)."""

    def lease_slots(self, keys: list[str], sizes: list[int] | None = None) -> Slots:
        """``lease`` as arrays; backends with a packed wire format answer it directly."""
        sizes = None if sizes is None else np.asarray(sizes, dtype=np.int64).tolist()  # plain ints
        return Slots.of(self.lease(keys, sizes))

    def reserve_slots(self, keys: list[str], sizes: list[int]) -> Slots:
        """``reserve`` as arrays, likewise."""
        return Slots.of(self.reserve(keys, np.asarray(sizes, dtype=np.int64).tolist()))  # plain ints

    @abstractmethod
    def release(self, keys: list[str]) -> None: ...

    @abstractmethod
    def remove(self, keys: list[str]) -> list[Status]: ...

    @abstractmethod
    def stats(self) -> dict: ...

    @abstractmethod
    def close(self) -> None: ...

    def generation(self) -> Generation | None:
        """The store's ``Generation`` as of the last reply, for caches that must notice
        restarts and deleted objects without asking; None when the backend cannot tell."""
        return None

    def events(self, cursor: int) -> dict | None:
        """The store's tier events after ``cursor`` (``{"epoch", "cursor", "lost", "codes",
        "event_keys"}``: backends/local/events.py), for KV events; None when the store
        keeps no event log (then no KV events are emitted)."""
        return None
