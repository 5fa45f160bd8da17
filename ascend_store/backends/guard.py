"""A circuit breaker in front of a backend.

A pool that is down must cost a request nothing: after one failed call further calls
fail at once for a backoff period (doubling up to a cap) instead of each waiting out
the timeout; then one call probes again.
"""

from __future__ import annotations

import logging
import threading
import time

from ascend_store.backends.base import Backend, BackendUnavailable

log = logging.getLogger("ascend_store")

_PASSTHROUGH = ("buffer", "exists", "reserve", "commit", "abort", "lease", "release", "remove",
                "stats", "events", "lease_slots", "reserve_slots")


class GuardedBackend:
    # Services known to be down in this process: the scheduler's and the worker's backends
    # of one engine share an outage, and it gets one warning, not one per client.
    _down: set[str] = set()

    def __init__(self, inner: Backend, service: str, first_backoff_s: float = 0.5,
                 max_backoff_s: float = 5.0):
        self.inner = inner
        self.service = service
        self._first, self._max = first_backoff_s, max_backoff_s
        self._backoff = 0.0
        self._open_until = 0.0
        self._lock = threading.Lock()
        self.failures = 0

    def __getattr__(self, name):
        if name not in _PASSTHROUGH:
            return getattr(self.inner, name)
        fn = getattr(self.inner, name)

        def guarded(*args, **kwargs):
            if time.monotonic() < self._open_until:
                raise BackendUnavailable("pool unavailable (backing off)")
            try:
                out = fn(*args, **kwargs)
            except BackendUnavailable as exc:
                with self._lock:
                    first = self.service not in GuardedBackend._down
                    GuardedBackend._down.add(self.service)
                    self.failures += 1
                    self._backoff = min(self._max, self._backoff * 2 or self._first)
                    self._open_until = time.monotonic() + self._backoff
                # One warning per outage; the retries while it lasts are debug noise.
                (log.warning if first else log.debug)(
                    "KV pool %s: %s failed (%s); requests recompute until it is back",
                    self.service, name, exc)
                raise
            if self._backoff:
                self._backoff = 0.0
                if self.service in GuardedBackend._down:
                    GuardedBackend._down.discard(self.service)
                    log.warning("KV pool %s reachable again", self.service)
            return out

        return guarded

    def close(self) -> None:
        self.inner.close()
