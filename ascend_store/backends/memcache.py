"""memcache (``memcache_hybrid.DistributedObjectStore``, Ascend MemFabric's object store).

Conventions of memcache_hybrid 1.3.0, observed against the real meta service and client
(tests/backends run them over host_shm and host_tcp with only the NPU driver stubbed):
``batch_put_from`` / ``batch_get_into`` return 0 per key on success (not a byte count);
``batch_get_into`` returns -3007 for a missing key and -3012 when the buffer size differs
from the object's (it must be exact, so a smaller object is fetched again at its size
from ``batch_get_key_info``); ``batch_is_exist`` returns 1 / 0 / negative; a put of an
existing key returns 0 and keeps the old value (``reserve`` asks ``batch_is_exist`` first);
with the meta service gone, calls return -3000 / -3014 within ~0.5 s and the client
reconnects by itself once it is back, but ``init`` waits for an absent meta service
forever (so we connect to it first); the client must be ``close()``d.

Every client contributes memory to the pool (``dram_size``), workers with a staging
buffer registered with the store. The scheduler only asks ``batch_is_exist``: it
contributes the smallest share (2 MiB) and registers nothing. vllm-ascend's scheduler joins
without memory (``init_bm=False``), but such a client segfaulted on its first call here
(with the stub driver) unless a client with memory was set up first in the process.
"""

from __future__ import annotations

import logging
import os
import socket
from urllib.parse import urlparse

from ascend_store.backends.base import BackendUnavailable, Slot
from ascend_store.backends.staged import StagedStoreBackend

log = logging.getLogger("ascend_store")
MISSING, SIZE_DIFFERS = -3007, -3012
UNREACHABLE = (-3000, -3014)  # the meta service is gone (observed: put/get, batch_is_exist)
G2H, H2G = 2, 3  # memcache_hybrid's copy directions: global <-> host memory (our staging buffer)
SCHEDULER_DRAM = 2 * 2**20  # memcache's allocation unit for the host protocols


def local_rank() -> int:
    """The worker's rank on its node, which is its NPU's index (one NPU per rank)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().local_rank
    except (AssertionError, ImportError, AttributeError):  # no vLLM world group (tools, tests)
        return int(os.environ.get("LOCAL_RANK", "0"))


class MemcacheBackend(StagedStoreBackend):
    def __init__(self, cfg, timeout_s: float, role: str):
        super().__init__(cfg.staging_size if role == "worker" else 2**20, timeout_s, "memcache")
        self.cfg = cfg
        self.role = role
        self.device_id = cfg.device if cfg.device is not None else (local_rank() if role == "worker" else 0)
        self._replicas = None

    def _connect(self):
        try:
            import memcache_hybrid
        except ImportError:
            raise BackendUnavailable("the memcache_hybrid package is not installed "
                                     "(pip install 'ascend-store[memcache]')") from None
        c = self.cfg
        url = urlparse(c.meta_service_url)
        try:
            socket.create_connection((url.hostname, url.port), timeout=self.timeout_s).close()
        except (OSError, ValueError, TypeError) as exc:
            raise BackendUnavailable(f"memcache meta service {c.meta_service_url} unreachable: "
                                     f"{exc}") from None
        local = memcache_hybrid.LocalConfig()
        local.meta_service_url = c.meta_service_url
        local.config_store_url = c.config_store_url
        local.protocol = c.protocol
        worker = self.role == "worker"
        local.dram_size = str(c.dram_size if worker else SCHEDULER_DRAM)
        local.hbm_size = str(c.hbm_size if worker else 0)
        store = memcache_hybrid.DistributedObjectStore()
        rc = store.setup(local)
        if rc == 0:
            rc = store.init(self.device_id, init_bm=True)
        if rc != 0:
            raise BackendUnavailable(f"memcache setup with {c.meta_service_url} failed ({rc})")
        if c.preferred_services:
            self._replicas = memcache_hybrid.ReplicateConfig()
            self._replicas.replicaNum = len(c.preferred_services)
            self._replicas.preferredLocalServiceIDs = list(c.preferred_services)
        return store

    def _setup(self):
        if self.role == "worker":
            return super()._setup()
        return self._connect()  # lookups only: no memory to register

    def _check(self, name: str, out: list) -> None:
        if any(r in UNREACHABLE for r in out):
            raise BackendUnavailable(f"memcache {name}: meta service unreachable ({min(out)})")

    def _get_into(self, keys: list[str], slots: list[Slot]) -> list[int]:
        res = self._call("batch_get_into", keys, [self._addr + s.offset for s in slots],
                         [s.size for s in slots], G2H)
        got = [s.size if rc == 0 else 0 for rc, s in zip(res, slots)]
        # Sizes were upper bounds (variable-size codecs): fetch those again at their size.
        redo = [i for i, rc in enumerate(res) if rc == SIZE_DIFFERS]
        if redo:
            infos = self._call("batch_get_key_info", [keys[i] for i in redo])
            fit = [(i, info.size()) for i, info in zip(redo, infos) if 0 < info.size() <= slots[i].size]
            if fit:
                res = self._call("batch_get_into", [keys[i] for i, _ in fit],
                                 [self._addr + slots[i].offset for i, _ in fit], [n for _, n in fit], G2H)
                for (i, n), rc in zip(fit, res):
                    got[i] = n if rc == 0 else 0
        return got

    def _put_args(self) -> tuple:
        return (H2G, self._replicas) if self._replicas is not None else (H2G,)
