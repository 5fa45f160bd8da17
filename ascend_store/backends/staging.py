"""The staging buffer of a store backend: shared memory that the owner's worker reads and
writes and the store helper process registers with the store, and the slots in it.

One call's slots (a step's loads or saves) are one contiguous region, taken and returned
with array arithmetic: the hot path has no loop over objects in Python. A region goes back
when its last key is released, committed or aborted.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from itertools import repeat

import numpy as np

from ascend_store.backends.alloc import ALIGN, FreeList

_NOT_HELD = (-1, 0, -1)  # (offset, size, region) of a key that holds no slot


class Staging:
    def __init__(self, size: int):
        # Shared with the helper by descriptor; close-on-exec, so no other child gets it.
        self.fd = os.memfd_create("ascend-store-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.size = size
        self._mem = mmap.mmap(self.fd, size)
        self._alloc = FreeList(size)
        self._held: dict[str, tuple[int, int, int]] = {}  # key -> (offset, size, region)
        self._regions: dict[int, list[int]] = {}  # region -> [offset, bytes, keys still held]
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def view(self) -> memoryview:
        return memoryview(self._mem)

    def take(self, keys: list[str], sizes: np.ndarray, want: np.ndarray | None = None) -> np.ndarray:
        """Slots for ``keys`` (where ``want``): their offsets, -1 for a key already held (or
        repeated), unwanted, or beyond the space there is."""
        n = len(keys)
        offs = np.full(n, -1, dtype=np.int64)
        fresh = np.ones(n, dtype=bool) if want is None else want.copy()
        with self._lock:
            if len(set(keys)) < n or not self._held.keys().isdisjoint(keys):  # rare: checked per key
                seen: set[str] = set()
                fresh &= np.fromiter((k not in self._held and not (k in seen or seen.add(k)) for k in keys),
                                     dtype=bool, count=n)
            room = np.where(fresh, (sizes + ALIGN - 1) // ALIGN * ALIGN, 0)
            ends = np.cumsum(room)
            if not n or not ends[-1]:
                return offs
            base = self._alloc.alloc(int(ends[-1]))
            if base is None:  # the leading keys that fit in the largest free segment
                fit = int(np.searchsorted(ends, self._alloc.largest(), side="right"))
                if not fit or not ends[fit - 1]:
                    return offs
                fresh[fit:] = False
                ends = ends[:fit]
                base = self._alloc.alloc(int(ends[-1]))
            idx = np.flatnonzero(fresh)
            offs[idx] = base + ends[idx] - room[idx]
            region = next(self._ids)
            self._regions[region] = [base, int(ends[-1]), len(idx)]
            got = keys if len(idx) == n else list(map(keys.__getitem__, idx.tolist()))
            self._held.update(zip(got, zip(offs[idx].tolist(), sizes[idx].tolist(), repeat(region))))
        return offs

    def find(self, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, sizes) of ``keys``' slots; offset -1 for a key that holds none."""
        with self._lock:
            held = np.array(list(map(self._held.get, keys, repeat(_NOT_HELD))), dtype=np.int64).reshape(-1, 3)
        return held[:, 0], held[:, 1]

    def free(self, keys: list[str]) -> None:
        """Return ``keys``' slots (keys that hold none are ignored)."""
        with self._lock:
            held = np.array(list(map(self._held.pop, keys, repeat(_NOT_HELD))), dtype=np.int64).reshape(-1, 3)
            regions, counts = np.unique(held[:, 2][held[:, 2] >= 0], return_counts=True)
            for region, count in zip(regions.tolist(), counts.tolist()):  # one per call that took them
                r = self._regions[region]
                r[2] -= count
                if not r[2]:
                    self._alloc.free(r[0], r[1])
                    del self._regions[region]

    def stats(self) -> tuple[int, int]:
        """(bytes in use, slots held)."""
        with self._lock:
            return self.size - self._alloc.free_bytes, len(self._held)

    def close(self) -> None:
        """Drop the descriptor (the mapping stays: the worker may still hold views of it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
