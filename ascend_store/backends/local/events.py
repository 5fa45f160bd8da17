"""The pool's event log: what was stored in or removed from which tier, for KV events.

Every ready object that appears in a tier (commit, a spill to disk, a promotion back to
memory) or leaves one (eviction, removal, a disk file dropped) appends one entry. The log
is a bounded ring with a running sequence number; a reader asks for the entries after the
last sequence number it saw (op ``events``) and learns how many it missed when it lagged
more than the ring holds. Readers are the schedulers' KV event feeds (ascend_store/scheduler/kv_events.py).
"""

from __future__ import annotations

from collections import deque
from itertools import islice

STORED, REMOVED = 0, 1
MEMORY, DISK = 0, 1
MEDIA = ("CPU", "DISK")  # the medium each tier's events name (vLLM's KV event ``medium``)
RING = 65536
MAX_PER_REPLY = 8192


class EventLog:
    def __init__(self, size: int = RING):
        self._ring: deque[tuple[int, str]] = deque(maxlen=size)
        self.seq = 0  # events logged so far
        self.counts = [0, 0, 0, 0]  # per code (kind * 2 + medium), for stats

    def add(self, kind: int, medium: int, key: str) -> None:
        code = kind * 2 + medium
        self._ring.append((code, key))
        self.counts[code] += 1
        self.seq += 1

    def since(self, cursor: int, limit: int = MAX_PER_REPLY) -> dict:
        """Entries after the first ``cursor`` (at most ``limit``): the new cursor, how many
        were lost (the ring moved past them, or ``cursor`` is from an earlier epoch), one
        code byte per entry and the keys."""
        oldest = self.seq - len(self._ring)
        if cursor > self.seq:
            cursor = 0
        start = max(cursor, oldest)
        end = min(self.seq, start + limit)
        entries = list(islice(self._ring, start - oldest, end - oldest))
        return {"cursor": end, "lost": start - cursor, "codes": bytes(c for c, _ in entries),
                "event_keys": [k for _, k in entries]}

    def stats(self) -> dict:
        kinds = ("stored", "removed")
        return {f"{kinds[c // 2]}_{MEDIA[c % 2].lower()}": n for c, n in enumerate(self.counts)}
