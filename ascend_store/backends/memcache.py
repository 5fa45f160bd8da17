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
forever (so we connect to it first); the client must be ``close()``d. The client runs in a
helper process (helper.py), as Mooncake's does: one client per process is also memcache's
own model (memfabric keeps a closed client's mappings for the life of its process).

Every client contributes memory to the pool (``dram_size``), workers with a staging
buffer registered with the store. The scheduler only asks ``batch_is_exist``: it
contributes the smallest share (2 MiB) and registers nothing. vllm-ascend's scheduler joins
without memory (``init_bm=False``), but such a client segfaulted on its first call here
(with the stub driver) unless a client with memory was set up first in the process.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from urllib.parse import urlparse

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.helper_protocol import ClientReset, StoreClient
from ascend_store.backends.staged import StagedStoreBackend
from ascend_store.common.config import MemcacheConfig

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
    client = "ascend_store.backends.memcache:MemcacheClient"

    def __init__(self, cfg, timeout_s: float, role: str):
        # The device is resolved here: the helper process has no vLLM world group.
        self.device_id = cfg.device if cfg.device is not None else (local_rank() if role == "worker" else 0)
        cfg = dataclasses.replace(cfg, device=self.device_id)
        super().__init__(cfg, role, cfg.staging_size if role == "worker" else 2**20, timeout_s, "memcache")
        self.cfg = cfg
        self.role = role


class MemcacheClient(StoreClient):
    """In the helper process."""

    def __init__(self, config: dict, role: str, timeout_s: float):
        self.cfg = MemcacheConfig(**config)
        self.role, self.timeout_s = role, timeout_s
        self.store = None
        self._put_args: tuple = (H2G,)

    def set_up(self, addr: int, size: int) -> None:
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
            rc = store.init(c.device, init_bm=True)
        if rc == 0 and worker:  # lookups only: no memory to register
            rc = store.register_buffer(addr, size)
        if rc != 0:
            raise ClientReset(f"memcache setup with {c.meta_service_url} failed ({rc})")
        if c.preferred_services:
            self._replicas = memcache_hybrid.ReplicateConfig()
            self._replicas.replicaNum = len(c.preferred_services)
            self._replicas.preferredLocalServiceIDs = list(c.preferred_services)
            self._put_args = (H2G, self._replicas)
        self.store = store

    def _checked(self, name: str, out: list) -> list:
        if any(r in UNREACHABLE for r in out):  # the client reconnects by itself: keep it
            raise BackendUnavailable(f"memcache {name}: meta service unreachable ({min(out)})")
        return out

    def exists(self, keys):
        return self._checked("batch_is_exist", self.store.batch_is_exist(keys))

    def put(self, keys, addrs, sizes):
        return self._checked("batch_put_from", self.store.batch_put_from(keys, addrs, sizes, *self._put_args))

    def get(self, keys, addrs, sizes):
        res = self._checked("batch_get_into", self.store.batch_get_into(keys, addrs, sizes, G2H))
        got = [n if rc == 0 else 0 for rc, n in zip(res, sizes)]
        # Sizes were upper bounds (variable-size codecs): fetch those again at their size.
        redo = [i for i, rc in enumerate(res) if rc == SIZE_DIFFERS]
        if redo:
            infos = self.store.batch_get_key_info([keys[i] for i in redo])
            fit = [(i, info.size()) for i, info in zip(redo, infos) if 0 < info.size() <= sizes[i]]
            if fit:
                res = self._checked("batch_get_into", self.store.batch_get_into(
                    [keys[i] for i, _ in fit], [addrs[i] for i, _ in fit], [n for _, n in fit], G2H))
                for (i, n), rc in zip(fit, res):
                    got[i] = n if rc == 0 else 0
        return got

    def remove(self, keys):
        return [self.store.remove(k) for k in keys]

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
