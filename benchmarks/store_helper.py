"""What running the Mooncake or memcache client in a helper process costs a save and a load.

Runs where the backend tests run (a private network namespace; memcache also needs the stub
Ascend driver):

    sh tests/backends/ascend_stub/sandbox.sh .venv/bin/python benchmarks/store_helper.py

It starts a real mooncake_master with a mooncake_client storage process, and the real
memcache meta service with a storage client, and moves the same objects two ways in one
run: ``in-process``, the store client class the helper runs, called straight from this
process with a staging buffer of its own (the arrangement before the helper, less its
thread hop), and ``helper``, the backend the engine uses (staging in shared memory, the
client in its helper process). A save is ``batch_is_exist`` + ``batch_put_from`` of new
objects (reserve + commit), a load one ``batch_get_into`` of them (lease + release).
Prints bytes/s, the median of ``--rounds`` calls, for each object shape (the two ways
take turns, so both see the same load on the machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)
from tests.backends.conftest import _memcache, _mooncake  # noqa: E402

SHAPES = ((16, 2**20), (256, 16 * 2**10))  # (objects per call, bytes each)
_round = itertools.count()


class InProcess:
    """The store client the helper runs, called from this process."""

    def __init__(self, backend):
        cls = type(backend).client.partition(":")[2]
        module = sys.modules[type(backend).__module__]
        self.buf = np.zeros(backend.staging.size, dtype=np.uint8)
        self.client = getattr(module, cls)(dataclasses.asdict(backend.cfg), "worker", 10.0)
        self.client.set_up(self.buf.ctypes.data, self.buf.nbytes)

    def save(self, keys, sizes):
        offs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        assert not any(self.client.exists(keys))
        rc = self.client.put(keys, (offs + self.buf.ctypes.data).tolist(), sizes.tolist())
        assert rc == [0] * len(keys)

    def load(self, keys, sizes):
        offs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        got = self.client.get(keys, (offs + self.buf.ctypes.data).tolist(), sizes.tolist())
        assert got == sizes.tolist()

    def close(self):
        self.client.close()


class Helper:
    def __init__(self, backend):
        self.b = backend

    def save(self, keys, sizes):
        slots = self.b.reserve_slots(keys, sizes)
        assert (slots.status == 0).all()
        assert [int(s) for s in self.b.commit(keys)] == [0] * len(keys)

    def load(self, keys, sizes):
        slots = self.b.lease_slots(keys, sizes)
        assert (slots.size == sizes).all()
        self.b.release(keys)

    def close(self):
        self.b.close()


def measure(ways: dict, rounds: int) -> dict:
    """{way: {shape: (save bytes/s, load bytes/s)}}; the ways take turns within each round,
    so both see the same load on the machine."""
    times = {(name, shape): ([], []) for name in ways for shape in SHAPES}
    for _ in range(rounds):
        for shape in SHAPES:
            n, size = shape
            sizes = np.full(n, size, dtype=np.int64)
            for name, way in ways.items():
                keys = [f"bench/{next(_round)}/{i}" for i in range(n)]
                t0 = time.perf_counter()
                way.save(keys, sizes)
                t1 = time.perf_counter()
                way.load(keys, sizes)
                save, load = times[(name, shape)]
                save.append(t1 - t0)
                load.append(time.perf_counter() - t1)
    return {name: {shape: tuple(shape[0] * shape[1] / statistics.median(t) for t in times[(name, shape)])
                   for shape in SHAPES} for name in ways}


def run(svc, rounds: int) -> None:
    svc.start_fn()
    try:
        backend = svc.backend(timeout_s=10.0)
        ways = {"in-process": InProcess(backend), "helper": Helper(backend)}
        measure(ways, 2)  # warm-up
        got = measure(ways, rounds)
        for way in ways.values():
            way.close()
    finally:
        svc.stop_fn()
    for (n, size) in SHAPES:
        a, b = got["in-process"][(n, size)], got["helper"][(n, size)]
        cells = [f"{what} {x / 1e9:6.2f} -> {y / 1e9:6.2f} GB/s ({y / x - 1:+.0%})"
                 for what, x, y in (("save", a[0], b[0]), ("load", a[1], b[1]))]
        print(f"{svc.kind:9s} {n:4d} x {size // 1024:5d} KiB  " + "   ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--only", choices=("mooncake", "memcache"))
    args = ap.parse_args()
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    tmp = pathlib.Path(tempfile.mkdtemp())
    storage = 2 * 2**30  # every round's objects stay: no eviction inside a measurement
    print("store      objects per call       in-process -> helper (median of %d calls)" % args.rounds)
    if args.only != "memcache":
        run(_mooncake(tmp, capacity=storage), args.rounds)
    if args.only != "mooncake":
        svc = _memcache(tmp, "host_shm", storage=storage)
        run(svc, args.rounds)


if __name__ == "__main__":
    main()
