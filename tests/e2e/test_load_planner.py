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

from tests.e2e.conftest import BLOCK, assert_same_outputs, kv_config, run_engine

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
