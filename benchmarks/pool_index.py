"""The local pool's index under eviction: cost of a reserve that must evict, by pool size.

A full pool (N objects of 16 KiB) takes 2,000 new objects in batches of 500, as a save
step does; each reserve evicts the least recently used object. The baseline, in the same
run: the same reserves into an empty pool (no eviction). Index only, no server or
socket: what the pool's one thread spends per object.

    python benchmarks/pool_index.py [--objects 1000 7000 50000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ascend_store.backends.local.index import PoolIndex  # noqa: E402

SIZE = 16 << 10
NEW, BATCH = 2000, 500


def fill(ix: PoolIndex, keys: list[str]) -> float:
    """Seconds to reserve and commit ``keys``, in batches; the reserves must succeed."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), BATCH):
        got = ix.reserve(keys[i:i + BATCH], [SIZE] * len(keys[i:i + BATCH]))
        if any(status.name != "OK" for status, _ in got):
            raise SystemExit("a reserve failed")
        ix.commit(keys[i:i + BATCH])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--objects", type=int, nargs="+", default=[1000, 7000, 50000])
    args = ap.parse_args()
    new = [f"new{i}" for i in range(NEW)]
    base = fill(PoolIndex(capacity=NEW * SIZE), new) / NEW
    print(f"reserve + commit into free space: {base * 1e6:.1f} us per object")
    for n in args.objects:
        ix = PoolIndex(capacity=n * SIZE)
        fill(ix, [f"old{i}" for i in range(n)])
        per = fill(ix, new) / NEW
        print(f"full pool of {n:6d} objects: {per * 1e6:7.1f} us per object that evicts "
              f"({per / base:.1f}x the free-space cost), {ix.counters['evictions']} evictions")


if __name__ == "__main__":
    main()
