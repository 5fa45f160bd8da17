"""A circuit breaker in front of a backend.

A pool that is down must cost a request nothing: after one failed call further calls
fail at once for a backoff period (doubling up to a cap) instead of each waiting out
the timeout; then one call probes again. It also counts the calls that reach the
backend by direction (``calls``: lookup, load, save, other), for the per-step stats.
"""

from __future__ import annotations

import logging
import threading
import time

from ascend_store.backends.base import Backend, BackendUnavailable

log = logging.getLogger("ascend_store")

_PASSTHROUGH = ("buffer", "exists", "tiers", "reserve", "commit", "abort", "lease", "release", "remove",
                "stats", "events", "lease_slots", "reserve_slots")
# Calls whose success shows the service answered, on every backend: a staged store answers
# buffer and events from its own process and its abort and release only free its own
# staging, and a call with no keys returns before asking anyone.
_ASKS = {"exists", "tiers", "reserve", "commit", "lease", "remove", "stats", "lease_slots", "reserve_slots"}
DIRECTION = {"exists": "lookup", "tiers": "lookup", "events": "lookup", "lease": "load",
             "lease_slots": "load", "release": "load", "remove": "load", "reserve": "save",
             "reserve_slots": "save", "commit": "save", "abort": "save"}


class GuardedBackend:
    # Services known to be down in this process: the scheduler's and the worker's backends
    # of one engine share an outage, and it gets one warning, not one per client.
    _down: set[str] = set()
    _down_lock = threading.Lock()  # the clients of one engine fail on their own threads

    def __init__(self, inner: Backend, service: str, first_backoff_s: float = 0.5,
                 max_backoff_s: float = 5.0):
        self.inner = inner
        self.service = service
        self._first, self._max = first_backoff_s, max_backoff_s
        self._backoff = 0.0
        self._open_until = 0.0
        self._lock = threading.Lock()
        self.failures = 0
        self.calls = {"lookup": 0, "load": 0, "save": 0, "other": 0}  # calls that reached the backend

    def available(self) -> bool:
        """False while the breaker is open (calls would fail at once)."""
        return time.monotonic() >= self._open_until

    def __getattr__(self, name):
        if name not in _PASSTHROUGH:
            return getattr(self.inner, name)
        fn = getattr(self.inner, name)
        direction = DIRECTION.get(name, "other")

        def guarded(*args, **kwargs):
            if time.monotonic() < self._open_until:
                raise BackendUnavailable("pool unavailable (backing off)")
            with self._lock:  # the worker calls from several threads
                self.calls[direction] += 1
            try:
                out = fn(*args, **kwargs)
            except BackendUnavailable as exc:
                with GuardedBackend._down_lock:
                    first = self.service not in GuardedBackend._down
                    GuardedBackend._down.add(self.service)
                with self._lock:
                    self.failures += 1
                    self._backoff = min(self._max, self._backoff * 2 or self._first)
                    self._open_until = time.monotonic() + self._backoff
                # One warning per outage; the retries while it lasts are debug noise.
                (log.warning if first else log.debug)(
                    "KV pool %s: %s failed (%s); requests recompute until it is back",
                    self.service, name, exc)
                raise
            answered = name in _ASKS and not (args and isinstance(args[0], list) and not args[0])
            if self._backoff and answered:
                self._backoff = 0.0
                with GuardedBackend._down_lock:
                    back = self.service in GuardedBackend._down
                    GuardedBackend._down.discard(self.service)
                if back:
                    log.warning("KV pool %s reachable again", self.service)
            return out

        return guarded

    def close(self) -> None:
        self.inner.close()
