"""The pool is never on the engine's critical path.

One engine (vLLM prefix caching on) serves a warm-up round, then three rounds against a
standalone pool:
1. eight new prompts arrive in one step, the pool up: they miss and are saved;
2. the pool is frozen (SIGSTOP) and the engine serves a mix: the same eight prompts (device
   hits, vLLM's own prefix cache) and eight new ones (misses whose lookups and saves meet
   the frozen pool);
3. the pool resumes (SIGCONT); vLLM's prefix cache is reset and the KV cache scrubbed, so
   the first eight come back from the pool.
Step times and the scheduler's pool calls are measured from outside the connector
(tests/e2e/runner.py ``instrument``).
"""

from __future__ import annotations

import random

import pytest

from tests.e2e.conftest import BLOCK, assert_same_outputs, kv_config, run_engine

pytestmark = pytest.mark.e2e
CHUNK = 2 * BLOCK  # pool objects of two blocks: prompts end in a one-block tail object
DEADLINE_S = 0.2
# Slack over "slowest step before the freeze + the lookup deadline", for a loaded 2-core
# CI machine; a step that waits for the frozen pool waits timeout_s (5 s) or more.
SLACK_S = 0.5


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(5 * BLOCK + 7)] for _ in range(8)]


def test_a_frozen_pool_never_stalls_a_step_and_lookups_batch_per_step(tmp_path, model, pool):
    warm, known, new = _prompts(20), _prompts(21), _prompts(22)
    kv = kv_config(pool.socket, chunk_size=CHUNK, lookup_timeout_s=DEADLINE_S)
    pid = pool.proc.pid
    r = run_engine(tmp_path, model, [warm, known, known + new, known], kv, prefix_caching=True,
                   reset_between_rounds=[3], instrument=True,
                   between=[None, f"kill -STOP {pid}", f"kill -CONT {pid} && sleep 6"])
    _, before, frozen, after = r["per_round"]
    # Eight requests arriving in one step: one lookup call answers all of them.
    assert before["pool_calls"].get("tiers", 0) == 1, before["pool_calls"]
    assert after["pool_calls"].get("tiers", 0) == 1, after["pool_calls"]
    assert r["scheduler"]["max_lookup_rpcs_per_step"] == 1
    # Frozen: every step as fast as before plus at most the lookup deadline, all tokens right.
    bound = max(before["step_seconds"]) + DEADLINE_S + SLACK_S
    assert max(frozen["step_seconds"]) <= bound, (max(frozen["step_seconds"]), bound)
    assert_same_outputs(r["rounds"][2][:8], r["rounds"][1])
    assert all(len(o["token_ids"]) == 8 for o in r["rounds"][2][8:])
    assert frozen["scheduler"]["lookup_timeouts"] + frozen["scheduler"].get("lookups_skipped", 0) > 0
    # Resumed: hits again (two full chunks and the one-block tail of each prompt).
    assert [o["num_cached_tokens"] for o in r["rounds"][3]] == [5 * BLOCK] * 8
    assert_same_outputs(r["rounds"][3], r["rounds"][1])
