"""Mooncake store (``mooncake.store.MooncakeDistributedStore``): the distributed pool.

Facts this relies on: a put of an existing key keeps the old value (so ``reserve`` asks
``batch_is_exist`` first and reports EXISTS); a get of a missing key returns a negative
code; reads hold a lease in the master (``--default_kv_lease_ttl``); the client listens
on all interfaces unless ``MC_TCP_BIND_ADDRESS`` is set; codes at or below RPC_FAIL (-900)
mean the master went away or restarted. ``setup`` holds the GIL while it waits on a
master that accepts connections but does not answer (stopped, overloaded): it froze every
thread of its process for minutes. The client therefore runs in a helper process
(helper.py) and this backend calls it there.
"""

from __future__ import annotations

import os
import socket

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.helper_protocol import ClientReset, StoreClient
from ascend_store.backends.staged import StagedStoreBackend
from ascend_store.common.config import StoreServiceConfig

RPC_FAILED = -900  # Mooncake's RPC_FAIL; codes at or below it mean the service is unreachable


class MooncakeBackend(StagedStoreBackend):
    client = "ascend_store.backends.mooncake:MooncakeClient"

    def __init__(self, cfg, timeout_s: float, role: str):
        # The scheduler only asks batch_is_exist: a small staging buffer is enough.
        super().__init__(cfg, role, cfg.staging_size if role == "worker" else 2**20, timeout_s, "mooncake")
        self.cfg = cfg
        self.role = role


class MooncakeClient(StoreClient):
    """In the helper process."""

    def __init__(self, config: dict, role: str, timeout_s: float):
        self.cfg = StoreServiceConfig(**config)
        self.role, self.timeout_s = role, timeout_s
        self.store = None

    def set_up(self, addr: int, size: int) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError:
            raise BackendUnavailable("the mooncake package is not installed "
                                     "(pip install 'ascend-store[mooncake]')") from None
        c = self.cfg
        # The binding's setup waits a long time for an absent master; a plain connect first
        # makes "master down" one quick failure that leaves this process reusable.
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
            raise ClientReset(f"mooncake setup with master {c.master} failed ({rc})")
        rc = store.register_buffer(addr, size)
        if rc != 0:
            raise ClientReset(f"registering the staging buffer failed ({rc})")
        self.store = store

    def _checked(self, name: str, out: list) -> list:
        if any(r <= RPC_FAILED for r in out):
            raise ClientReset(f"mooncake {name}: master unreachable ({min(out)})")
        return out

    def exists(self, keys):
        return self._checked("batch_is_exist", self.store.batch_is_exist(keys))

    def put(self, keys, addrs, sizes):
        return self._checked("batch_put_from", self.store.batch_put_from(keys, addrs, sizes))

    def get(self, keys, addrs, sizes):
        # Mooncake answers the byte count; a miss is a negative code.
        got = self._checked("batch_get_into", self.store.batch_get_into(keys, addrs, sizes))
        return [max(int(n), 0) for n in got]

    def remove(self, keys):
        return [self.store.remove(k) for k in keys]

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
