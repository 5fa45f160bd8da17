"""memcache (Ascend MemFabric, ``memcache_hybrid.DistributedObjectStore``).

Its client API mirrors Mooncake's (setup, batch_is_exist, batch_put_from, batch_get_into
on registered buffers), so it shares ``StagedStoreBackend``. The data plane needs Ascend
drivers and CANN: here it is tested only against a stand-in that follows the API
(tests/backends/memcache_standin.py). UNVERIFIED ON HARDWARE.

Mapping of our keys: ``master`` -> ``meta_service_url`` (``tcp://host:port`` if no scheme),
``metadata_server`` -> ``config_store_url``, ``protocol``, ``device`` -> NPU device id,
``global_segment_size`` -> ``dram_size``.
"""

from __future__ import annotations

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.staged import StagedStoreBackend


class MemcacheBackend(StagedStoreBackend):
    def __init__(self, cfg, timeout_s: float, role: str):
        super().__init__(cfg.staging_size if role == "worker" else 2**20, timeout_s, "memcache")
        self.cfg = cfg

    def _connect(self):
        try:
            import memcache_hybrid
        except ImportError:
            raise BackendUnavailable("the memcache_hybrid package is not installed "
                                     "(pip install 'ascend-store[memcache]')") from None
        c = self.cfg
        local = memcache_hybrid.LocalConfig()
        local.meta_service_url = c.master if "://" in c.master else f"tcp://{c.master}"
        if c.metadata_server != "P2PHANDSHAKE":
            local.config_store_url = c.metadata_server
        local.protocol = c.protocol
        local.dram_size = c.global_segment_size
        store = memcache_hybrid.DistributedObjectStore()
        rc = store.setup(local)
        if rc == 0:
            rc = store.init(int(c.device or 0))
        if rc != 0:
            raise BackendUnavailable(f"memcache setup with {local.meta_service_url} failed ({rc})")
        return store
