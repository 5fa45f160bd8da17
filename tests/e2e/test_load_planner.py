"""The load planner in a real engine (scheduler/planner.py, ``load_planner: true``).

Three 1,920-token prompts in 256-token objects. A pool whose loads are slow (the worker's
lease takes a second: a throttled tier) against a tiny model that computes a prompt in
milliseconds: the first hit loads (no load cost measured yet), the planner measures it,
and the next hits are recomputed. With the pool fast, every hit loads. Either way every
answer is the one computed without the pool. The time each choice saves is the
benchmark's to show, not this test's."""

from __future__ import annotations

import json
import random

import pytest

from tests.e2e.conftest import BLOCK, Pool, assert_same_outputs, kv_config, run_engine

pytestmark = pytest.mark.e2e


def _run(tmp_path, model, pool, slow: bool, monkeypatch) -> dict:
    fault = tmp_path / "fault.json"
    if slow:
        fault.write_text(json.dumps({"role": "worker", "op": "lease", "kind": "latency", "seconds": 1.0}))
    monkeypatch.setenv("ASCEND_STORE_TEST_FAULT", str(fault))
    kv = kv_config(pool.socket, load_planner=True, chunk_size=8 * BLOCK, local={"start": "never"},
                   backend="tests.e2e.faulty_backend:FaultyBackend")
    rng = random.Random(11)
    p0, p1, p2 = ([rng.randrange(2, 500) for _ in range(60 * BLOCK)] for _ in range(3))
    # One step computes all three (no hit: the answers to compare with, and the compute
    # cost), then one request per round, each a hit of 1,919 tokens.
    r = run_engine(tmp_path, model, [[p0, p1, p2], [p0], [p1], [p2]], kv)
    for i, later in enumerate(r["rounds"][1:]):
        assert_same_outputs(later, [r["rounds"][0][i]])
    return r


def test_a_slow_pool_is_loaded_once_then_recomputed(tmp_path, model, pool, monkeypatch):
    r = _run(tmp_path, model, pool, True, monkeypatch)
    assert [o["num_cached_tokens"] for rnd in r["rounds"] for o in rnd] == [0, 0, 0, 1919, 0, 0]
    s = r["scheduler"]
    assert (s["loads_planned"], s["recomputes_planned"]) == (1, 2)
    assert s["planner_load_us_per_token"] > s["planner_compute_us_per_token"]


def test_a_fast_pool_is_loaded(tmp_path, model, pool, monkeypatch):
    r = _run(tmp_path, model, pool, False, monkeypatch)
    assert [o["num_cached_tokens"] for rnd in r["rounds"][1:] for o in rnd] == [1919, 1919, 1919]
    s = r["scheduler"]
    assert s["loads_planned"] == 3 and s.get("recomputes_planned", 0) == 0
    assert s["planner_load_us_per_token"] < s["planner_compute_us_per_token"]


def test_a_hit_loads_its_head_from_memory_and_computes_its_tail_on_a_slow_disk(tmp_path, model, monkeypatch):
    """Per tier: the pool's disk costs 0.1 s an object (a slow disk), memory is fast. Engine A
    computes S+X and Z; the pool stops (its memory tier goes to disk) and starts again. Engine
    B measures computing (W), a memory hit (W again) and a disk hit (S+Y: S from disk, which
    the lease brings back to memory). Then S+X, whose head S is in memory and tail X on
    disk, loads S and computes X; Z, all on disk, is computed. Every answer is A's."""
    socket, disk = str(tmp_path / "pool" / "pool.sock"), str(tmp_path / "disk")
    flags = ("--disk-path", disk, "--disk-capacity", "64MiB")
    rng = random.Random(5)
    chunk = 4 * BLOCK

    def tokens(n):
        return [rng.randrange(2, 500) for _ in range(n)]

    s, x, y = (tokens(4 * chunk) for _ in range(3))
    z, w = tokens(8 * chunk), tokens(8 * chunk)
    fault = tmp_path / "fault.json"
    monkeypatch.setenv("ASCEND_STORE_TEST_FAULT", str(fault))
    kv = kv_config(socket, load_planner=True, chunk_size=chunk, local={"start": "never"},
                   backend="tests.e2e.faulty_backend:FaultyBackend")
    pool = Pool(socket, "64MiB", flags).start()
    try:
        a = run_engine(tmp_path, model, [[s + x + [7]], [z + [7]]], kv)
    finally:
        pool.stop(30)  # a graceful stop writes the memory tier to disk
    fault.write_text(json.dumps({"role": "worker", "op": "lease", "kind": "disk_latency", "seconds": 0.1}))
    pool = Pool(socket, "64MiB", flags).start()
    try:
        b = run_engine(tmp_path, model, [[w + [7]], [w + [7]], [s + y + [7]], [s + x + [7]], [z + [7]]], kv)
    finally:
        pool.stop()
    cached = [o["num_cached_tokens"] for rnd in b["rounds"] for o in rnd]
    assert cached == [0, len(w), len(s), len(s), 0]
    assert_same_outputs(b["rounds"][3], a["rounds"][0])
    assert_same_outputs(b["rounds"][4], a["rounds"][1])
    sched = b["scheduler"]
    assert (sched["loads_planned"], sched["partial_loads_planned"], sched["recomputes_planned"]) == (3, 1, 2)
    assert sched["planner_disk_load_us_per_token"] > 10 * sched["planner_load_us_per_token"]
