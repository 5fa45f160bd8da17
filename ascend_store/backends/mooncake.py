"""Mooncake store (``mooncake.store.MooncakeDistributedStore``): the distributed pool.

Facts this relies on: a put of an existing key keeps the old value (so ``reserve`` asks
``batch_is_exist`` first and reports EXISTS); a get of a missing key returns a negative
code; reads hold a lease in the master (``--default_kv_lease_ttl``); the client listens
on all interfaces unless ``MC_TCP_BIND_ADDRESS`` is set; the binding does not release the
GIL while it waits, so our thread-based timeout bounds only what it returns from.
"""

from __future__ import annotations

import os
import socket

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.staged import StagedStoreBackend


class MooncakeBackend(StagedStoreBackend):
    def __init__(self, cfg, timeout_s: float, role: str):
        # The scheduler only asks batch_is_exist: a small staging buffer is enough.
        super().__init__(cfg.staging_size if role == "worker" else 2**20, timeout_s, "mooncake")
        self.cfg = cfg
        self.role = role

    def _connect(self):
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:
            raise BackendUnavailable("the mooncake package is not installed "
                                     "(pip install 'ascend-store[mooncake]')") from None
        c = self.cfg
        # The binding's setup holds the GIL while it retries an absent master for a long
        # time; a plain connect first keeps "master down" within our timeout.
        host, _, port = c.master.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=self.timeout_s).close()
        except (OSError, ValueError) as exc:
            raise BackendUnavailable(f"mooncake master {c.master} unreachable: {exc}") from None
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", c.local_hostname)
        store = MooncakeDistributedStore()
        # Only workers contribute memory to the distributed pool.
        segment = c.global_segment_size if self.role == "worker" else 0
        rc = store.setup(c.local_hostname, c.metadata_server, segment, c.local_buffer_size,
                         c.protocol, c.device, c.master)
        if rc != 0:
            raise BackendUnavailable(f"mooncake setup with master {c.master} failed ({rc})")
        return store
