"""First-fit allocation over a range of host memory (the pool's arena, a staging buffer)."""

from __future__ import annotations

ALIGN = 512


def aligned(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


class FreeList:
    """First-fit allocation over [0, capacity) with exact-size reuse and coalescing. Free
    segments are also indexed by size, so the common case of a full pool of like-sized
    objects (a segment just freed fits the next object exactly) takes no scan."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_off: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._by_size: dict[int, dict[int, None]] = {}  # size -> offsets (ordered, as a set)
        self.free_bytes = capacity
        if capacity:
            self._add(0, capacity)

    def alloc(self, size: int) -> int | None:
        same = self._by_size.get(size)
        off = next(iter(same)) if same else next((o for o, s in self._by_off.items() if s >= size), None)
        if off is None:
            return None
        seg = self._drop(off)
        if seg > size:
            self._add(off + size, seg - size)
        self.free_bytes -= size
        return off

    def largest(self) -> int:
        """The largest free segment: the most one allocation can get now."""
        return max(self._by_size, default=0)

    def free(self, off: int, size: int) -> int:
        """Return the block; the result is the size of the coalesced free segment."""
        self.free_bytes += size
        if off in self._by_end:  # a free segment ends where this one starts
            prev = self._by_end[off]
            size += self._drop(prev)
            off = prev
        if off + size in self._by_off:
            size += self._drop(off + size)
        self._add(off, size)
        return size

    def _add(self, off: int, size: int) -> None:
        self._by_off[off] = size
        self._by_end[off + size] = off
        self._by_size.setdefault(size, {})[off] = None

    def _drop(self, off: int) -> int:
        size = self._by_off.pop(off)
        del self._by_end[off + size]
        same = self._by_size[size]
        del same[off]
        if not same:
            del self._by_size[size]
        return size
