"""The local pool's disk tier against plain file I/O on the same disk, in one run.

Rows (GB/s, median of --rounds; objects of --object-mib from a shared-memory buffer like the pool's arena):
  tier write        DiskTier.put of every object (what a spill costs: CRC32 + write + rename)
  tier read warm    DiskTier.read_into, files still in the page cache (a recent spill)
  tier read cold    the same after fsync + POSIX_FADV_DONTNEED on every file (from the disk)
  int8 tier ...     the same three with ``disk_codec: int8``: each object stored in its INT8 form
                    (spill_int8.py: encode on write, decode on read), GB/s of the objects' own bytes
  O_DIRECT write/read  the same objects written and read with O_DIRECT (4 KiB-aligned, no CRC):
                    whether bypassing the page cache would pay on this disk
  plain write/read  one file of the same bytes, written and read (cold) in 4 MiB pieces
  cp                shutil.copyfile of that file (cold source)
Each object is a chunk object of 8 layer parts of bf16 attention pages (random normal values),
sealed like the worker's, so both codecs store what they would store for a model.
Usage: python benchmarks/disk_tier.py [--dir DIR] [--objects N] [--object-mib M] [--rounds R] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import numpy as np  # noqa: E402

from ascend_store.backends.local.disk import DiskTier  # noqa: E402
from ascend_store.common.header import (  # noqa: E402
    ELEM_BF16,
    FLAG_WSUM,
    HEADER,
    HEADER_BYTES,
    HEADER_VERSION,
    MAGIC,
)

PIECE = 4 * 2**20
PARTS = 8  # layer parts per object


def _drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _direct(directory: str, views) -> tuple[float, float]:
    paths = [os.path.join(directory, f"d{i}") for i in range(len(views))]
    flags = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_DIRECT

    def write():
        for p, v in zip(paths, views):
            fd = os.open(p, flags, 0o600)
            os.pwritev(fd, [v], 0)
            os.close(fd)

    def read():
        for p, v in zip(paths, views):
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            os.preadv(fd, [v], 0)
            os.close(fd)

    w = _timed(write)
    r = _timed(read)
    for p in paths:
        os.unlink(p)
    return w, r


def _fill(view: memoryview, payload: int) -> None:
    """A chunk object of PARTS bf16 attention parts of ``payload`` bytes each (the header's
    checksum is not computed: nothing here checks it)."""
    head = np.frombuffer(HEADER.pack(MAGIC, HEADER_VERSION, FLAG_WSUM, bytes(8), payload, 0, 0, ELEM_BF16),
                         dtype=np.uint8)
    rows = np.frombuffer(view, dtype=np.uint8).reshape(PARTS, HEADER_BYTES + payload)
    x = np.random.default_rng(len(rows)).standard_normal((PARTS, payload // 2), dtype=np.float32)
    rows[:, :HEADER_BYTES] = head
    rows[:, HEADER_BYTES:] = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def _tier_rows(directory: str, codec: str, keys, views, total: int) -> dict[str, float]:
    label = "tier" if codec == "raw" else f"{codec} tier"
    tier = DiskTier(os.path.join(directory, label.replace(" ", "-")), total * 2, codec=codec)
    back = [memoryview(bytearray(len(v))) for v in views]

    def read():
        for k, b in zip(keys, back):
            tier.read_into(k, b)

    rows = {f"{label} write": _timed(lambda: [tier.put(k, v) for k, v in zip(keys, views)])}
    rows[f"{label} read warm"] = _timed(read)
    _drop_cache(os.path.join(tier.directory, n) for n in os.listdir(tier.directory) if n.endswith(".obj"))
    rows[f"{label} read cold"] = _timed(read)
    assert tier.counters["corrupt"] == 0
    assert tier.counters["int8_writes"] == (len(keys) if codec == "int8" else 0)
    tier.close()
    return rows


def _round(directory: str, keys, views, slots, view, total: int) -> dict[str, float]:
    os.makedirs(directory)
    rows = {**_tier_rows(directory, "raw", keys, views, total),
            **_tier_rows(directory, "int8", keys, views, total)}
    try:
        rows["O_DIRECT write"], rows["O_DIRECT read"] = _direct(directory, slots)
    except OSError as exc:
        print(f"O_DIRECT unavailable here: {exc.strerror}", file=sys.stderr)
    plain = os.path.join(directory, "plain")

    def write_plain():
        with open(plain, "wb") as f:
            for i in range(0, total, PIECE):
                f.write(view[i:i + PIECE])

    def read_plain():
        with open(plain, "rb", buffering=0) as f:
            for i in range(0, total, PIECE):
                f.readinto(view[i:i + PIECE])

    rows["plain write"] = _timed(write_plain)
    _drop_cache([plain])
    rows["plain read cold"] = _timed(read_plain)
    _drop_cache([plain])
    rows["cp"] = _timed(lambda: shutil.copyfile(plain, plain + ".copy"))
    shutil.rmtree(directory)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None,
                    help="directory on the disk to measure (default: a temp dir in /var/tmp)")
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--object-mib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (medians are printed)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    # Parts of whole 4 KiB pages of bf16 values; objects in 4 KiB-aligned slots (O_DIRECT
    # moves whole slots: their padding is under 1% of an object of 1 MiB or more).
    payload = max(4096, int(args.object_mib * 2**20) // PARTS // 4096 * 4096)
    size = PARTS * (HEADER_BYTES + payload)
    stride = -(-size // 4096) * 4096
    total = stride * args.objects
    base = tempfile.mkdtemp(prefix="ascend-disk-bench-", dir=args.dir or "/var/tmp")
    arena = mmap.mmap(-1, total)  # page-aligned, like the pool's arena
    view = memoryview(arena)
    views = [view[i * stride:i * stride + size] for i in range(args.objects)]
    slots = [view[i * stride:(i + 1) * stride] for i in range(args.objects)]
    for v in views:
        _fill(v, payload)
    keys = [f"bench/g0/tp0of1/L0-27/{i:032x}" for i in range(args.objects)]
    samples: dict[str, list[float]] = {}
    try:
        # Every row runs once per round; round 0 is a warm-up that is not counted: the first
        # writes after a quiet spell ran ~10x slower here (the kernel reclaiming page cache),
        # whichever row came first.
        for r in range(args.rounds + 1):
            got = _round(os.path.join(base, f"r{r}"), keys, views, slots, view, total)
            for name, secs in got.items():
                if r:
                    samples.setdefault(name, []).append(secs)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = {name: statistics.median(v) for name, v in samples.items()}
    # GB/s of what each row moves: the objects' own bytes for the tiers, whole slots for the rest.
    out = {name: (size * args.objects if "tier" in name else total) / secs / 1e9
           for name, secs in rows.items()}
    print(f"{args.objects} objects of {size / 2**20:.1f} MiB ({total / 2**30:.2f} GiB) in {base}, "
          f"median of {args.rounds} rounds")
    print(f"{'row':18s} GB/s")
    for name, gbs in out.items():
        print(f"{name:18s} {gbs:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"objects": args.objects, "object_bytes": size, "rounds": args.rounds, "gbps": out,
                       "samples_s": samples}, f, indent=1)


if __name__ == "__main__":
    main()
