"""Backends over a distributed object store with registered client memory (Mooncake
store, memcache).

Such stores move bytes between their servers and client memory registered with them
(``batch_put_from`` / ``batch_get_into``). The backend owns one staging buffer in shared
memory (staging.py): ``reserve`` hands out staging slots that ``commit`` publishes with one
``batch_put_from``; ``lease`` fetches objects into staging slots with one
``batch_get_into`` and ``release`` frees the slots.

The store's client runs in a helper process (helper.py) that maps the same buffer, so a
binding that holds the GIL while a service hangs freezes only that process. Every call
has a deadline; one that misses it gets the helper killed (which ends its transfers) and
replaced. Every failed call returns its staging slots once no transfer can still touch
them, so an outage leaks nothing.

Generation: these stores report no deletions to a client, so ``generation()`` changes
only its epoch, each time a client is set up (after the service failed or restarted, or
its helper was replaced): lookup caches then drop everything. An object evicted while the
service stays up remains a cached hit until the cache's ``ttl_s`` (docs/backends.md): its
load fails and the chunk is recomputed.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from itertools import compress

import numpy as np

from ascend_store.backends.base import STATUSES, Backend, BackendUnavailable, Generation, Slots, Status
from ascend_store.backends.helper import StoreHelper
from ascend_store.backends.staging import Staging

_NO_SLOTS = Slots(*(np.zeros(0, dtype=np.int64) for _ in range(3)))


class StagedStoreBackend(Backend):
    """Subclasses name the ``StoreClient`` their helper runs (``client``: "module:Class",
    helper_protocol.py) and pass its config (a dataclass)."""

    client = ""

    def __init__(self, cfg, role: str, staging_bytes: int, timeout_s: float, epoch: str):
        self.timeout_s = timeout_s
        self.epoch = epoch
        self.staging = Staging(staging_bytes)
        spec = {"config": dataclasses.asdict(cfg), "role": role, "timeout_s": timeout_s}
        self.helper = StoreHelper(self.client, spec, self.staging.fd, staging_bytes, timeout_s)
        self.helper.start()
        self.rpcs = 0

    def generation(self) -> Generation | None:
        return Generation(f"{self.epoch}-{self.helper.setups}") if self.helper.setups else None

    def _call(self, op: str, keys: list[str], offsets=None, sizes=None) -> np.ndarray:
        """One store call; on failure the keys' staging slots (if any) are returned once
        no transfer of the call can still touch them."""
        self.rpcs += 1
        try:
            out = self.helper.call(op, keys, offsets, sizes)
            if len(out) != len(keys):
                raise BackendUnavailable(f"store {op}: {len(out)} answers for {len(keys)} keys")
            return out
        except BackendUnavailable:
            if offsets is not None:
                self.helper.after_transfers(partial(self.staging.free, keys))
            raise

    # -- Backend --------------------------------------------------------------
    def buffer(self):
        return self.epoch, self.staging.view()

    def _exists(self, keys: list[str]) -> np.ndarray:
        res = self._call("exists", keys)
        if (res < 0).any():
            raise BackendUnavailable(f"batch_is_exist failed ({res.min()})")
        return res == 1

    def exists(self, keys):
        return self._exists(keys).tolist() if keys else []

    def reserve(self, keys, sizes):
        return self.reserve_slots(keys, sizes).to_list()

    def reserve_slots(self, keys, sizes) -> Slots:
        if not keys:
            return _NO_SLOTS
        sizes = np.asarray(sizes, dtype=np.int64)
        present = self._exists(keys)  # a put never replaces an object: report EXISTS instead
        offs = self.staging.take(keys, sizes, want=~present)
        ok = offs >= 0
        status = np.where(present, Status.EXISTS, np.where(ok, Status.OK, Status.NO_SPACE))
        return Slots(status.astype(np.int64), np.where(ok, offs, 0), sizes)

    def commit(self, keys):
        if not keys:
            return []
        offs, sizes = self.staging.find(keys)
        held = offs >= 0
        out = np.full(len(keys), Status.MISSING, dtype=np.int64)
        if held.any():
            todo = keys if held.all() else list(compress(keys, held))
            rc = self._call("put", todo, offs[held], sizes[held])
            self.staging.free(todo)
            out[held] = np.where(rc == 0, Status.OK, Status.MISSING)
        return [STATUSES[s] for s in out.tolist()]

    def abort(self, keys):
        self.staging.free(keys)

    def lease(self, keys, sizes=None):
        return self.lease_slots(keys, sizes).to_list()

    def lease_slots(self, keys, sizes=None) -> Slots:
        if not keys:
            return _NO_SLOTS
        if sizes is None:
            raise ValueError("this backend needs the expected object sizes to lease")
        sizes = np.asarray(sizes, dtype=np.int64)
        offs = self.staging.take(keys, sizes)
        ok = offs >= 0
        got = np.zeros(len(keys), dtype=np.int64)
        if ok.any():
            todo = keys if ok.all() else list(compress(keys, ok))
            got[ok] = self._call("get", todo, offs[ok], sizes[ok])
        hit = ok & (got > 0) & (got <= sizes)  # never more than its slot holds
        if (ok & ~hit).any():
            self.staging.free(list(compress(keys, ok & ~hit)))
        return Slots(np.where(hit, Status.OK, Status.MISSING).astype(np.int64), np.where(hit, offs, 0),
                     np.where(hit, got, 0))

    def release(self, keys):
        self.staging.free(keys)

    def remove(self, keys):
        if not keys:
            return []
        return [Status.OK if rc == 0 else Status.MISSING for rc in self._call("remove", keys).tolist()]

    def stats(self) -> dict:
        """The staging buffer's use. Like the local pool's, it fails while the store is out
        of reach (its client cannot be set up), so it never passes for a sign of recovery."""
        self._call("ping", [])
        used, slots = self.staging.stats()
        return {"capacity": self.staging.size, "used_bytes": used, "evictions": 0, "staging_slots": slots}

    def close(self) -> None:
        self.helper.close()
        self.staging.close()
