"""Lookup economy against a real engine: 40 concurrent requests sharing a 90% prefix.

All 40 are scheduled in one step (max_num_seqs=40, a large token budget), so per-round
counts at the pool server are per-step counts. vLLM's prefix cache is off: every reuse
is the pool's.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.e2e.conftest import BLOCK, REPO, assert_same_outputs, kv_config, run_engine, shared_prefix_prompts

pytestmark = pytest.mark.e2e
TAMPER = f"{sys.executable} {os.path.join(REPO, 'tests', 'e2e', 'pool_tamper.py')}"
OBJECTS_PER_CHUNK = 1  # one chunk object holds all 4 layers (one KV cache group, TP 1)


def test_forty_requests_one_query_per_key_and_cache_invalidation(tmp_path, model, pool):
    prompts = shared_prefix_prompts(40)
    stats = [tmp_path / f"stats{i}.json" for i in range(3)]
    status = f"{sys.executable} -m ascend_store.ops.cli pool status --socket {pool.socket}"
    between = [f"{status} > {stats[0]}",
               f"{status} > {stats[1]} && {TAMPER} remove {pool.socket} shared:0"]
    r = run_engine(tmp_path, model, [prompts, prompts, prompts], kv_config(pool.socket),
                   between=between, engine_args={"max_num_seqs": 40, "max_num_batched_tokens": 16384},
                   max_tokens=4)
    first, second, third = r["rounds"]
    s0, s1 = (json.loads(p.read_text()) for p in stats[:2])
    shared_chunks, own_chunks = 9, 1

    # Round 1, empty pool: the 40 requests arrive in one step and are asked in one call,
    # each distinct key once (9 shared chunks + 40 own chunks, one object each); all miss.
    distinct = (shared_chunks + 40 * own_chunks) * OBJECTS_PER_CHUNK
    assert all(o["num_cached_tokens"] == 0 for o in first)
    assert s0["key_queries"]["tiers"] == distinct
    # Round 2: the saves invalidated those misses, so every request hits the pool, and each
    # distinct key was asked once again.
    assert all(o["num_cached_tokens"] == 10 * BLOCK for o in second)
    assert s1["key_queries"]["tiers"] - s0["key_queries"]["tiers"] == distinct
    assert r["scheduler"]["max_lookup_rpcs_per_step"] == 1
    # The worker leased each distinct object once in that step, with no key repeated in a call.
    assert s1["key_queries"]["lease"] - s0["key_queries"].get("lease", 0) == distinct
    assert s1["repeated_keys"] == 0
    assert_same_outputs(second, first)

    # Round 3: the shared prefix was removed behind the cache's back; its cached hits are
    # stale, the loads fail, vLLM recomputes, and the tokens stay right.
    assert r["worker"]["load_missing"] > 0 and r["worker"]["failed_blocks"] > 0
    assert_same_outputs(third, first)
