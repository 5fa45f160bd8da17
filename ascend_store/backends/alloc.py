"""First-fit allocation over a range of host memory (the pool's arena, a staging buffer)."""

from __future__ import annotations

ALIGN = 512


def aligned(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


class FreeList:
    """First-fit allocator over [0, capacity) with exact-size reuse and coalescing."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_off: dict[int, int] = {0: capacity} if capacity else {}
        self._by_end: dict[int, int] = {capacity: 0} if capacity else {}
        self.free_bytes = capacity

    def alloc(self, size: int) -> int | None:
        off = next((o for o, s in self._by_off.items() if s == size), None)
        if off is None:
            off = next((o for o, s in self._by_off.items() if s >= size), None)
        if off is None:
            return None
        seg = self._drop(off)
        if seg > size:
            self._add(off + size, seg - size)
        self.free_bytes -= size
        return off

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

    def _drop(self, off: int) -> int:
        size = self._by_off.pop(off)
        del self._by_end[off + size]
        return size
