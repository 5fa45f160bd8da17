"""Non-blocking loads (``async_load``, whole mode) in a real vLLM engine: a pool hit waits in
WAITING_FOR_REMOTE_KVS, the worker loads it on its own thread and reports it through
get_finished; failed chunks go through the load-error path and are recomputed. The
latency effect (the other requests keep decoding) is measured by
benchmarks/async_load.py, not asserted here. Three engines: about 2.5 min on 2 CPU cores."""

from __future__ import annotations

import os
import sys

import pytest

from tests.e2e.conftest import REPO, assert_same_outputs, kv_config, prompts, run_engine

pytestmark = pytest.mark.e2e
TAMPER = f"{sys.executable} {os.path.join(REPO, 'tests', 'e2e', 'pool_tamper.py')}"


def test_whole_mode_hits_load_off_the_step_and_failures_recompute(tmp_path, model, baseline, pool):
    kv = kv_config(pool.socket, use_layerwise=False, local={"start": "never"})
    first = run_engine(tmp_path, model, [prompts()], kv)  # computes and saves
    assert first["worker"].get("async_load_requests", 0) == 0  # nothing to load yet
    assert_same_outputs(first["rounds"][0], baseline)

    # A fresh engine: round 1 hits every prompt in the pool; before round 2 prompt 0's
    # objects are damaged, so its async load fails and vLLM recomputes from the first bad block.
    r = run_engine(tmp_path, model, [prompts(), prompts()], kv, between=[f"{TAMPER} flip {pool.socket} basic:0"])
    one, two = r["per_round"][0]["worker"], r["per_round"][1]["worker"]
    assert [o["num_cached_tokens"] for o in r["rounds"][0]] == [96, 128, 159]
    assert one["async_load_requests"] == 3 and one.get("failed_blocks", 0) == 0  # get_finished reported each
    assert_same_outputs(r["rounds"][0], baseline)
    assert two["async_load_requests"] == 6 and two["load_corrupt"] > 0 and two["failed_blocks"] > 0
    assert r["rounds"][1][0]["num_cached_tokens"] < 96  # recomputed from the damaged block
    assert_same_outputs(r["rounds"][1], baseline)

    # The blocking path (async_load off) gives the same tokens and reports nothing async.
    sync = run_engine(tmp_path, model, [prompts()], {**kv, "kv_connector_extra_config": {
        **kv["kv_connector_extra_config"], "async_load": False}})
    assert sync["worker"].get("async_load_requests", 0) == 0 and sync["worker"]["loaded_objects"] > 0
    assert_same_outputs(sync["rounds"][0], baseline)
