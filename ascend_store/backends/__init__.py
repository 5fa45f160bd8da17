"""Pool backends behind one small interface (see ``base.Backend``)."""

from ascend_store.backends.base import Backend, BackendUnavailable, Slot, Status
from ascend_store.backends.guard import GuardedBackend


def create_backend(cfg, *, role: str) -> GuardedBackend:
    """Build the backend named in the config. ``role`` is 'scheduler' or 'worker'."""
    if cfg.backend == "local":
        from ascend_store.backends.local.client import LocalBackend

        inner = LocalBackend(cfg.local, timeout_s=cfg.timeout_s, map_arena=(role == "worker"))
        return GuardedBackend(inner)
    raise ValueError(f"backend {cfg.backend!r} is not available")


__all__ = ["Backend", "BackendUnavailable", "Slot", "Status", "create_backend"]
