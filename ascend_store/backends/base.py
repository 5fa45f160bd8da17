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
from abc import ABC, abstractmethod
from typing import NamedTuple


class Status(enum.IntEnum):
    OK = 0
    MISSING = 1  # no such (readable) object
    EXISTS = 2  # reserve: already stored, nothing to write
    NO_SPACE = 3  # reserve: nothing evictable frees enough room
    INVALID = 4  # malformed key or size
    BUSY = 5  # remove: the object is leased by a reader


class BackendUnavailable(RuntimeError):
    """The service did not answer within the timeout, or is not running."""


class Slot(NamedTuple):  # a tuple: a 32K-token hit builds thousands of them per step
    status: Status
    offset: int = 0
    size: int = 0


STATUSES = tuple(Status)  # Status by value, faster than Status(value)


class Backend(ABC):
    @abstractmethod
    def buffer(self) -> tuple[str, memoryview]:
        """(epoch, host memory that slot offsets index). The epoch changes when the
        service restarts; slots from an older epoch are void."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]: ...

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

    @abstractmethod
    def release(self, keys: list[str]) -> None: ...

    @abstractmethod
    def remove(self, keys: list[str]) -> list[Status]: ...

    @abstractmethod
    def stats(self) -> dict: ...

    @abstractmethod
    def close(self) -> None: ...

    def generation(self) -> tuple[str, int] | None:
        """(epoch, evictions) as of the last reply, for caches that must notice restarts
        and evictions without asking; None when the backend cannot tell."""
        return None
