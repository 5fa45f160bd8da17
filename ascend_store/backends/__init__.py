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
    else:
        module, _, name = cfg.backend.partition(":")
        inner = getattr(importlib.import_module(module), name)(cfg, role)
    return GuardedBackend(inner)


__all__ = ["Backend", "BackendUnavailable", "Slot", "Status", "create_backend"]
