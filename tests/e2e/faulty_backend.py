"""A fault-injecting backend for tests: the real local pool client with faults on top.

Loaded by the engine through the config's class-path backend
(``"backend": "tests.e2e.faulty_backend:FaultyBackend"``). The fault to inject is read
on every call from the JSON file named by ``ASCEND_STORE_TEST_FAULT``, so a test can
change it between rounds of one engine:

    {"role": "worker" | "scheduler", "op": "lease", "kind": KIND, "seconds": 0.2, "after": 3}

KIND: error (raise), hang (wait out the timeout, then raise), latency (sleep, then
succeed), partial (every other key MISSING), misplace (hand out another object's slot),
short (a slot one byte short), drop (fail every call after ``after`` calls), disk_latency
(sleep ``seconds`` for each key the pool holds on its disk tier, then succeed: a slow disk).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from ascend_store.backends.base import TIER_DISK, BackendUnavailable, Slot, Slots, Status
from ascend_store.backends.local.client import LocalBackend


class FaultyBackend:
    def __init__(self, cfg, role: str):
        self.role = role
        self.timeout_s = cfg.timeout_s
        self.inner = LocalBackend(cfg.local, timeout_s=cfg.timeout_s, map_arena=(role == "worker"))
        self.calls = 0

    def _fault(self, op: str) -> dict | None:
        path = os.environ.get("ASCEND_STORE_TEST_FAULT")
        if not path or not os.path.exists(path):
            return None
        spec = json.load(open(path))
        if spec.get("role", self.role) != self.role or spec.get("op", op) != op:
            return None
        return spec

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _call(self, op: str, *args):
        spec = self._fault(op)
        kind = spec and spec["kind"]
        self.calls += 1
        if kind == "error" or (kind == "drop" and self.calls > spec.get("after", 0)):
            raise BackendUnavailable(f"injected {op} error")
        if kind == "hang":
            time.sleep(self.timeout_s)
            raise BackendUnavailable(f"injected {op} timeout")
        if kind == "latency":
            time.sleep(spec.get("seconds", 0.1))
        if kind == "disk_latency":
            time.sleep(spec.get("seconds", 0.1) * self.inner.tiers(args[0]).count(TIER_DISK))
        out = getattr(self.inner, op)(*args)
        if kind == "partial" and op in ("exists", "tiers"):
            out = [f if i % 2 == 0 else type(f)(0) for i, f in enumerate(out)]
        elif kind == "partial":  # hide every other object (and give back its lease)
            hidden = [k for i, (k, s) in enumerate(zip(args[0], out)) if i % 2 and s.status is Status.OK]
            if op == "lease":
                self.inner.release(hidden)
            out = [Slot(Status.MISSING) if i % 2 else s for i, s in enumerate(out)]
        elif kind == "misplace" and len(out) > 1:
            out = out[1:] + out[:1]
        elif kind == "short":
            out = [Slot(s.status, s.offset, s.size - 1) if s.status is Status.OK else s for s in out]
        return out

    def exists(self, keys):
        return self._call("exists", keys)

    def tiers(self, keys):
        return self._call("tiers", keys)

    def lease(self, keys, sizes=None):
        return self._call("lease", keys, sizes)

    def reserve(self, keys, sizes):
        return self._call("reserve", keys, sizes)

    # The worker asks for arrays: the same calls, the same faults.
    def lease_slots(self, keys, sizes=None):
        return Slots.of(self.lease(keys, sizes))

    def reserve_slots(self, keys, sizes):
        return Slots.of(self.reserve(keys, np.asarray(sizes, dtype=np.int64).tolist()))

    def commit(self, keys):
        return self._call("commit", keys)

    def close(self):
        self.inner.close()
