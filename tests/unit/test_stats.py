"""IntervalCounters under the threads that really use it: a load thread and a save thread
count the way loads.py and saves.py do while the engine thread reports (``take``) and
reads totals, as ``get_kv_connector_stats`` does. Takes STRESS_S (10 s)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

from ascend_store.ops.stats import GAUGES, IntervalCounters

STRESS_S = 10.0


def _loads(counters: IntervalCounters, stop: threading.Event, mine: Counter) -> None:
    """loads.py: a job's objects and bytes, misses, and the roll-back of a rejected object."""
    rng = random.Random(1)
    while not stop.is_set():
        n, size = rng.randrange(1, 9), rng.randrange(1, 1 << 16)
        counters["loaded_objects"] += n
        counters["loaded_bytes"] += n * size
        mine["loaded_objects"] += n
        mine["loaded_bytes"] += n * size
        if rng.random() < 0.1:
            counters["load_missing"] += 1
            mine["load_missing"] += 1
        if rng.random() < 0.05:  # a corrupt object: counted, then taken back
            counters["load_corrupt"] += 1
            counters["loaded_objects"] -= 1
            counters["loaded_bytes"] -= size
            mine["load_corrupt"] += 1
            mine["loaded_objects"] -= 1
            mine["loaded_bytes"] -= size


def _saves(counters: IntervalCounters, stop: threading.Event, mine: Counter) -> None:
    """saves.py: per-object commits, raw bytes, and ``save_skipped_<status>`` keys that
    appear while others read (new keys keep appearing here, so a reader iterating a
    shared dict would meet one being added)."""
    rng = random.Random(2)
    i = 0
    while not stop.is_set():
        i += 1
        size = rng.randrange(1, 1 << 16)
        counters["saved_objects"] += 1
        counters["saved_bytes"] += size
        counters["saved_raw_bytes"] += 2 * size
        mine["saved_objects"] += 1
        mine["saved_bytes"] += size
        mine["saved_raw_bytes"] += 2 * size
        if i % 1000 == 0:
            key = f"save_skipped_status{i // 1000}"
            counters[key] += 1
            mine[key] += 1


def test_counters_exact_while_threads_count_and_the_engine_reports():
    counters = IntervalCounters()
    stop = threading.Event()
    expected = [Counter(), Counter()]
    threads = [threading.Thread(target=f, args=(counters, stop, m))
               for f, m in zip((_loads, _saves), expected)]
    for t in threads:
        t.start()
    reported: Counter = Counter()
    reads = steps = 0
    deadline = time.monotonic() + STRESS_S
    try:
        while time.monotonic() < deadline:  # the engine thread: pool_worker.stats()
            steps += 1
            counters["steps"] += 1
            counters["pool_used_bytes"] = steps
            for k, v in counters.take().items():
                if k not in GAUGES:
                    reported[k] += v
            assert counters.total["steps"] == steps
            reads += 1
    finally:
        stop.set()
        for t in threads:
            t.join()
    for k, v in counters.take().items():
        if k not in GAUGES:
            reported[k] += v
    want = expected[0] + expected[1]
    want["steps"] = steps
    total = counters.total
    assert total.pop("pool_used_bytes") == steps
    assert want["saved_objects"] > 10_000 and want["save_skipped_status10"] == 1 and reads > 100
    assert total == want
    assert +reported == want  # every increment reported exactly once


def test_reads_see_this_threads_share_and_totals_sum_all():
    counters = IntervalCounters()
    counters["rpcs"] += 2

    def other():
        counters["rpcs"] += 5
        counters["max_rpcs_per_step"] = 3

    t = threading.Thread(target=other)
    t.start()
    t.join()
    counters["max_rpcs_per_step"] = 7
    assert counters["rpcs"] == 2
    assert counters.total["rpcs"] == 7
    assert counters.take() == {"rpcs": 7, "max_rpcs_per_step": 7}  # a gauge: the largest
