"""Pool backends behind one small interface (see ``base.Backend``)."""

import importlib

from ascend_store.backends.base import Backend, BackendUnavailable, Slot, Status
from ascend_store.backends.guard import GuardedBackend


def create_backend(cfg, *, role: str) -> GuardedBackend:
    """Build the backend named in the config behind a circuit breaker.

    ``role`` is 'scheduler' (lookups only) or 'worker' (moves bytes). A class path
    ``package.module:ClassName`` names a backend of your own, built as ``Class(cfg, role)``.
    """
    if cfg.backend == "local":
        from ascend_store.backends.local.client import LocalBackend

        inner = LocalBackend(cfg.local, timeout_s=cfg.timeout_s, map_arena=(role == "worker"))
        service = f"local pool {cfg.local.socket}"
    elif cfg.backend == "mooncake":
        from ascend_store.backends.mooncake import MooncakeBackend

        inner = MooncakeBackend(cfg.mooncake, cfg.timeout_s, role)
        service = f"mooncake master {cfg.mooncake.master}"
    elif cfg.backend == "memcache":
        from ascend_store.backends.memcache import MemcacheBackend

        inner = MemcacheBackend(cfg.memcache, cfg.timeout_s, role)
        service = f"memcache meta service {cfg.memcache.meta_service_url}"
    else:
        module, _, name = cfg.backend.partition(":")
        inner = getattr(importlib.import_module(module), name)(cfg, role)
        service = cfg.backend
    return GuardedBackend(inner, service)


__all__ = ["Backend", "BackendUnavailable", "Slot", "Status", "create_backend"]
