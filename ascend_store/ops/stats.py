"""Connector stats for vLLM's logging and Prometheus paths.

Workers and the scheduler each report the change of their counters since the last
report (``IntervalCounters``); vLLM sums the reports (``AscendStoreStats.aggregate``) and
hands the payload to the log line and to ``AscendStorePromMetrics``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from ascend_store.backends.base import Status

# Why a save left objects out: the pool's answer to their reserve (saves.py counts each but OK).
_NOT_RESERVED = {Status.EXISTS: " (already stored)", Status.INVALID: " (a malformed key or size)",
                 Status.NO_SPACE: " (nothing evictable frees enough room)"}
# Summed across reports and exported as Prometheus counters (name -> help text).
COUNTERS = {
    "lookups": "prefix lookups",
    "lookup_rpcs": "lookups that called the pool",
    "lookup_errors": "lookups that failed (pool unavailable)",
    "lookup_timeouts": "requests whose lookup was not answered within lookup_timeout_s (misses)",
    "lookups_skipped": "requests that missed without asking: the pool was known to be down",
    "hit_tokens": "prompt tokens found in the pool beyond the device cache",
    "queried_tokens": "prompt tokens looked up",
    "producer_waits": "prefilled requests that waited for the producer's objects (consumer_wait_s)",
    "producer_wait_timeouts": "of those, requests that reached consumer_wait_s short of their prompt",
    "compacted_skips": "requests' steps not saved: the request's KV was compacted (kv_compacted)",
    "decode_chunks": "chunks completed during decode, saved for a later turn (save_decode_cache)",
    "cache_hits": "lookup-cache answers used",
    "cache_misses": "lookup-cache answers missing or expired",
    "invalidations": "lookup-cache entries invalidated",
    "loaded_objects": "objects loaded",
    "loaded_bytes": "bytes loaded",
    "saved_objects": "objects saved",
    "saved_bytes": "bytes saved",
    "load_missing": "objects missing at load",
    "load_corrupt": "objects rejected by header or checksum",
    "load_lossy_refused": "loads refused: the request asks for lossless KV, the object came back "
                          "from a lossy tier form (disk_codec int8)",
    "load_errors": "load jobs that failed",
    "load_timeouts": "loads abandoned at load_timeout_s",
    "loads_started_at_schedule": "steps whose loads started as the scheduler built the step",
    "loads_before_forward": "steps that loaded everything before the forward (whole mode, full graphs)",
    "async_load_requests": "requests whose off-step load ended: landed, failed or cancelled (async_load)",
    "deferred_state_copies": "hybrid models: vLLM's state copies run once their layer's state landed",
    "failed_blocks": "blocks reported to vLLM for recompute",
    "save_errors": "save jobs that failed",
    "save_skipped_unanswered": "save jobs dropped: the pool had not answered their reserve by the next step",
    **{f"save_skipped_{s.name.lower()}": f"objects not saved: the pool answered their reserve {s.name}"
       f"{_NOT_RESERVED.get(s, '')}" for s in Status if s is not Status.OK},
    "save_incomplete": "objects reserved but not wholly written by the commit (given back)",
    "saved_raw_bytes": "KV bytes saved, before the codec (saved_bytes over this: its ratio)",
    "deferred_drains": "steps whose saves finished at the start of the next step (defer_save_drain)",
    "rpcs": "calls to the pool from workers",
    "load_rpcs": "workers' pool calls for loads (lease, release, remove)",
    "save_rpcs": "workers' pool calls for saves (reserve, commit, abort)",
    "steps": "worker steps",
    "selftest_layers": "layer parts the KV layout self-test round-tripped at start",
    "selftest_failed": "KV layout self-tests that failed (that worker's pool is off)",
    "loads_planned": "pool hits the load planner loaded (load_planner)",
    "recomputes_planned": "pool hits the load planner recomputed (all or a part): loading was slower",
    "partial_loads_planned": "pool hits the load planner loaded a prefix of and recomputed the rest",
    "load_tokens_planned": "tokens of the hits the load planner loaded",
    "recompute_tokens_planned": "tokens of the hits the load planner recomputed",
}
# Kept as the latest (largest) value instead of summed.
GAUGES = {"max_rpcs_per_step": "most pool calls in one worker step",
          "max_lookup_rpcs_per_step": "most lookup calls the scheduler started in one step",
          "max_load_rpcs_per_step": "most load calls in one worker step",
          "max_save_rpcs_per_step": "most save calls in one worker step",
          "pool_used_bytes": "pool bytes in use", "pool_capacity_bytes": "pool capacity",
          "pool_evictions": "objects the pool evicted since it started",
          "planner_compute_us_per_token": "the load planner's compute time per prefill token (us)",
          "planner_load_us_per_token": "the load planner's load time per pool token in memory (us)",
          "planner_disk_load_us_per_token": "the load planner's load time per token on the pool's disk (us)",
          "planner_load_call_us": "the load planner's load time per loading step, beyond its tokens' (us)"}
SECONDS = {"load_seconds": "time in load jobs", "save_seconds": "time in save copies",
           "lookup_seconds": "time in lookups", "selftest_seconds": "time in the KV layout self-test"}


class IntervalCounters:
    """Cumulative counters plus the delta since the last ``take``, safe across threads.

    ``c[key] += n`` is a read then a write: on one shared dict two threads would lose
    updates, and a reader iterating it could meet a key being added. So each thread
    counts in a Counter of its own (``c[key]`` reads this thread's share) and readers
    (``total``, ``take``) sum the shares; gauges take the largest.
    """

    def __init__(self):
        self._local = threading.local()
        self._shares: list[Counter[str]] = []
        self._lock = threading.Lock()  # guards the list of shares, not the counting
        self._reported: Counter[str] = Counter()

    def _mine(self) -> Counter[str]:
        try:
            return self._local.share
        except AttributeError:
            share = self._local.share = Counter()
            with self._lock:
                self._shares.append(share)
            return share

    def __getitem__(self, key: str):
        return self._mine()[key]

    def __setitem__(self, key: str, value) -> None:
        self._mine()[key] = value

    @property
    def total(self) -> Counter[str]:
        with self._lock:
            shares = list(self._shares)
        # dict() of a dict copies in C without running Python code, so the owner thread
        # cannot add a key half way (the GIL is not released in between).
        snaps = [dict(share) for share in shares]
        out: Counter[str] = Counter()
        for snap in snaps:
            out.update(snap)
        for k in GAUGES.keys() & out.keys():
            out[k] = max(snap[k] for snap in snaps if k in snap)
        return out

    def take(self) -> dict[str, float]:
        total = self.total
        out = {k: v - self._reported[k] for k, v in total.items() if k not in GAUGES}
        out.update({k: v for k, v in total.items() if k in GAUGES})
        self._reported = total
        return {k: v for k, v in out.items() if v}


class StepCalls:
    """A worker's pool calls per step, by direction (a ``GuardedBackend``'s ``calls``):
    counted (``load_rpcs``) and the most in one step kept (``max_load_rpcs_per_step``)."""

    DIRECTIONS = ("load", "save")

    def __init__(self, counters: IntervalCounters):
        self.counters = counters
        self._seen = dict.fromkeys(self.DIRECTIONS, 0)

    def end_step(self, calls: dict[str, int]) -> None:
        for d in self.DIRECTIONS:
            n, self._seen[d] = calls[d] - self._seen[d], calls[d]
            self.counters[f"{d}_rpcs"] += n
            gauge = f"max_{d}_rpcs_per_step"
            self.counters[gauge] = max(self.counters[gauge], n)


class PoolOccupancy:
    """The pool's occupancy gauges, asked at most every ``every_s`` on a thread of their
    own: vLLM collects stats on the engine's thread, which must never wait for the pool."""

    def __init__(self, backend, counters: IntervalCounters, every_s: float = 5.0):
        self.backend, self.counters, self.every_s = backend, counters, every_s
        self._at = 0.0
        self._running: Future | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ascend-store-stats")

    def poll(self) -> None:
        now = time.monotonic()
        if now - self._at >= self.every_s and (self._running is None or self._running.done()):
            self._at = now
            self._running = self._thread.submit(self._ask)

    def _ask(self) -> None:
        from ascend_store.backends import BackendUnavailable

        try:
            s = self.backend.stats()
        except BackendUnavailable:
            return
        self.counters["pool_used_bytes"] = s["used_bytes"]
        self.counters["pool_capacity_bytes"] = s["capacity"]
        self.counters["pool_evictions"] = s["evictions"]

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


@dataclass
class AscendStoreStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> AscendStoreStats:
        for k, v in other.data.items():
            self.data[k] = max(self.data.get(k, 0), v) if k in GAUGES else self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = dict(self.data)
        for kind in ("load", "save"):
            secs = d.get(f"{kind}_seconds", 0)
            if secs:
                d[f"{kind}_gbps"] = round(d.get(f"{kind}ed_bytes", 0) / secs / 1e9, 3)
        return d

    def is_empty(self) -> bool:
        return not any(self.data.values())


class AscendStorePromMetrics(KVConnectorPromMetrics):
    """``vllm:ascend_store_*`` metrics, one child per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, dict[int, Any]] = {}
        for kinds, cls, suffix in ((COUNTERS, self._counter_cls, "_total"),
                                   (SECONDS, self._counter_cls, "_total"),
                                   (GAUGES, self._gauge_cls, "")):
            for name, doc in kinds.items():
                metric = cls(name=f"vllm:ascend_store_{name}{suffix}", documentation=doc,
                             labelnames=labelnames)
                self._metrics[name] = {idx: metric.labels(*values)
                                       for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            child = self._metrics.get(name, {}).get(engine_idx)
            if child is None:
                continue
            if name in GAUGES:
                child.set(value)
            elif value > 0:
                child.inc(value)
