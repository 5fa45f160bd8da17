"""Backends over a distributed object store with registered client memory (Mooncake
store, memcache).

Such stores move bytes between their servers and client memory registered with them
(``batch_put_from`` / ``batch_get_into``). The backend owns one registered staging
buffer: ``reserve`` hands out staging slots that ``commit`` publishes with one
``batch_put_from``; ``lease`` fetches objects into staging slots with one
``batch_get_into`` and ``release`` frees the slots. Every store call runs on a helper
thread and is abandoned after the timeout; the slots such a call used are never reused
(a late transfer could still touch them), and the store call is retried only after the
circuit breaker's backoff.

Generation: these stores report no deletions to a client, so ``generation()`` changes
only its epoch, each time the client is set up again (after the service failed or
restarted): lookup caches then drop everything. An object evicted while the service
stays up remains a cached hit until the cache's ``ttl_s`` (docs/backends.md): its load
fails and the chunk is recomputed.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading

import numpy as np

from ascend_store.backends.alloc import FreeList, aligned
from ascend_store.backends.base import Backend, BackendUnavailable, Generation, Slot, Status

log = logging.getLogger("ascend_store")
RPC_FAILED = -900  # Mooncake's RPC_FAIL; codes at or below it mean the service is unreachable


class StagedStoreBackend(Backend):
    """Subclasses implement ``_connect`` (create, set up and return the store client) and
    may override how the store's return codes read (``_check``, ``_get_into``)."""

    def __init__(self, staging_bytes: int, timeout_s: float, epoch: str):
        self.timeout_s = timeout_s
        self.epoch = epoch
        self._buf = np.zeros(staging_bytes, dtype=np.uint8)
        self._addr = self._buf.ctypes.data
        self._alloc = FreeList(staging_bytes)
        self._slots: dict[str, tuple[int, int, int]] = {}  # key -> staging (offset, alloc, size)
        self._lock = threading.Lock()
        self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ascend-store-store")
        self.store = None
        self.rpcs = 0
        self._setups = 0  # client set-ups so far: the generation's epoch

    def _connect(self):
        """Create and set up the store client; raise BackendUnavailable when it cannot."""
        raise NotImplementedError

    def _setup(self):
        store = self._connect()
        rc = store.register_buffer(self._addr, self._buf.nbytes)
        if rc != 0:
            raise BackendUnavailable(f"registering the staging buffer failed ({rc})")
        self._setups += 1
        return store

    def generation(self) -> Generation | None:
        return Generation(f"{self.epoch}-{self._setups}") if self._setups else None

    def _check(self, name: str, out: list) -> None:
        """Mooncake: codes at or below RPC_FAIL mean the service went away (or restarted):
        set the client up again next time."""
        if any(isinstance(r, int) and r <= RPC_FAILED for r in out):
            self.store = None

    def _get_into(self, keys: list[str], slots: list[Slot]) -> list[int]:
        """Fetch ``keys`` into their staging slots (``size``: the most each may be); the
        bytes each read, 0 for a miss. Mooncake returns the byte count itself."""
        res = self._call("batch_get_into", keys, [self._addr + s.offset for s in slots],
                         [s.size for s in slots])
        return [max(int(n), 0) for n in res]

    def _put_args(self) -> tuple:
        """Arguments of ``batch_put_from`` after keys, addresses and sizes."""
        return ()

    def _call(self, name: str, *args):
        """Run one store call on the helper thread, bounded by the timeout. The store is
        set up on first use, so an engine starts even while the service is down."""
        self.rpcs += 1

        def run():
            if self.store is None:
                self.store = self._setup()
            return getattr(self.store, name)(*args)

        try:
            fut = self._pool.submit(run)
        except RuntimeError:  # the interpreter is shutting down
            raise BackendUnavailable("backend closed") from None
        try:
            out = fut.result(timeout=self.timeout_s)
            if isinstance(out, list):
                self._check(name, out)
            return out
        except cf.TimeoutError:
            # The call may still complete later: give it its own thread and never reuse it.
            self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ascend-store-store")
            raise BackendUnavailable(f"{name} timed out after {self.timeout_s}s") from None
        except BackendUnavailable:
            raise
        except Exception as exc:  # the store's bindings raise assorted errors
            self.store = None
            raise BackendUnavailable(f"store call failed: {exc}") from None

    def _take(self, keys: list[str], sizes: list[int]) -> list[Slot]:
        out = []
        with self._lock:
            for key, size in zip(keys, sizes):
                off = None if key in self._slots else self._alloc.alloc(aligned(size))
                if off is None:
                    out.append(Slot(Status.NO_SPACE))
                    continue
                self._slots[key] = (off, aligned(size), size)
                out.append(Slot(Status.OK, off, size))
        return out

    def _free(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                if (slot := self._slots.pop(key, None)) is not None:
                    self._alloc.free(slot[0], slot[1])

    def _forget(self, keys: list[str]) -> None:
        """Drop slots a timed-out call may still touch, without freeing their memory."""
        with self._lock:
            for key in keys:
                self._slots.pop(key, None)

    # -- Backend --------------------------------------------------------------
    def buffer(self) -> tuple[str, memoryview]:
        return self.epoch, memoryview(self._buf)

    def exists(self, keys):
        if not keys:
            return []
        res = self._call("batch_is_exist", keys)
        if any(r < 0 for r in res):
            raise BackendUnavailable(f"batch_is_exist failed ({min(res)})")
        return [r == 1 for r in res]

    def reserve(self, keys, sizes):
        if not keys:
            return []
        present = self.exists(keys)
        slots = self._take([k for k, p in zip(keys, present) if not p],
                           [s for s, p in zip(sizes, present) if not p])
        it = iter(slots)
        return [Slot(Status.EXISTS) if p else next(it) for p in present]

    def commit(self, keys):
        held = [(k, self._slots.get(k)) for k in keys]
        todo = [(k, s) for k, s in held if s is not None]
        out = {k: Status.MISSING for k in keys}
        if todo:
            try:
                res = self._call("batch_put_from", [k for k, _ in todo],
                                 [self._addr + s[0] for _, s in todo], [s[2] for _, s in todo],
                                 *self._put_args())
            except BackendUnavailable:
                self._forget([k for k, _ in todo])
                raise
            for (k, _), rc in zip(todo, res):
                out[k] = Status.OK if rc == 0 else Status.MISSING
            self._free([k for k, _ in todo])
        return [out[k] for k in keys]

    def abort(self, keys):
        self._free(keys)

    def lease(self, keys, sizes=None):
        if not keys:
            return []
        if sizes is None:
            raise ValueError("this backend needs the expected object sizes to lease")
        slots = self._take(keys, sizes)
        ok = [(k, s) for k, s in zip(keys, slots) if s.status is Status.OK]
        try:
            res = self._get_into([k for k, _ in ok], [s for _, s in ok]) if ok else []
        except BackendUnavailable:
            self._forget([k for k, _ in ok])
            raise
        got = {}
        for (k, s), n in zip(ok, res):
            if n > 0:
                got[k] = Slot(Status.OK, s.offset, n)
            else:
                self._free([k])
        return [got.get(k, Slot(Status.MISSING)) for k in keys]

    def release(self, keys):
        self._free(keys)

    def remove(self, keys):
        out = []
        for k in keys:
            rc = self._call("remove", k)
            out.append(Status.OK if rc == 0 else Status.MISSING)
        return out

    def stats(self) -> dict:
        with self._lock:
            used = self._alloc.capacity - self._alloc.free_bytes
        return {"capacity": self._alloc.capacity, "used_bytes": used, "evictions": 0,
                "staging_slots": len(self._slots)}

    def close(self) -> None:
        store, self.store = self.store, None
        self._pool.shutdown(wait=False)
        if store is not None:
            try:
                store.close()
            except Exception as exc:  # closing must not fail a shutdown
                log.debug("closing the store client: %s", exc)
