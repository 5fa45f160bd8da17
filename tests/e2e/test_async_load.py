"""Non-blocking loads (``async_load``, whole mode) in a real vLLM engine: a pool hit waits in
WAITING_FOR_REMOTE_KVS, the worker loads it on its own thread and reports it through
get_finished; failed chunks go through the load-error path and are recomputed, and so
are loads past their deadline (``load_timeout_s``). The
latency effect (the other requests keep decoding) is measured by
benchmarks/async_load.py, not asserted here. Three engines: about 70 s on 2 CPU cores."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.e2e.conftest import REPO, assert_same_outputs, kv_config, prompts, run_engine

pytestmark = pytest.mark.e2e
TAMPER = f"{sys.executable} {os.path.join(REPO, 'tests', 'e2e', 'pool_tamper.py')}"


def test_whole_mode_hits_load_off_the_step_and_failures_recompute(tmp_path, model, baseline, pool,
                                                                   monkeypatch):
    kv = kv_config(pool.socket, use_layerwise=False, local={"start": "never"})
    first = run_engine(tmp_path, model, [prompts()], kv)  # computes and saves
    assert first["worker"].get("async_load_requests", 0) == 0  # nothing to load yet
    assert_same_outputs(first["rounds"][0], baseline)

    # A fresh engine: round 1 hits every prompt in the pool; before round 2 prompt 0's
    # objects are damaged, so its async load fails and vLLM recomputes from the first bad
    # block; before round 3 every lease is made to take 8 s, past the 4 s deadline, so the
    # loads are cancelled and recomputed. (The real pool client under a fault injector.) The
    # deadline leaves a fresh engine's first load room on a busy 2-core CI machine: at 1 s
    # round 1 once timed out there.
    fault = tmp_path / "fault.json"
    monkeypatch.setenv("ASCEND_STORE_TEST_FAULT", str(fault))
    slow_lease = json.dumps({"role": "worker", "op": "lease", "kind": "latency", "seconds": 8})
    faulty = {**kv, "kv_connector_extra_config": {**kv["kv_connector_extra_config"], "load_timeout_s": 4.0,
                                                  "backend": "tests.e2e.faulty_backend:FaultyBackend"}}
    r = run_engine(tmp_path, model, [prompts()] * 3, faulty,
                   between=[f"{TAMPER} flip {pool.socket} basic:0", f"echo '{slow_lease}' > {fault}"])
    one, two, three = (r["per_round"][i]["worker"] for i in range(3))
    assert [o["num_cached_tokens"] for o in r["rounds"][0]] == [96, 128, 159], one
    assert one["async_load_requests"] == 3 and one.get("failed_blocks", 0) == 0  # get_finished reported each
    assert two["async_load_requests"] == 6 and two["load_corrupt"] > 0 and two["failed_blocks"] > 0
    assert r["rounds"][1][0]["num_cached_tokens"] < 96  # recomputed from the damaged block
    assert three["async_load_requests"] == 9 and three["load_timeouts"] > two.get("load_timeouts", 0)
    assert all(o["num_cached_tokens"] == 0 for o in r["rounds"][2])  # every load past its deadline
    for out in r["rounds"]:
        assert_same_outputs(out, baseline)

    # The blocking path (async_load off) gives the same tokens and reports nothing async.
    sync = run_engine(tmp_path, model, [prompts()], {**kv, "kv_connector_extra_config": {
        **kv["kv_connector_extra_config"], "async_load": False}})
    assert sync["worker"].get("async_load_requests", 0) == 0 and sync["worker"]["loaded_objects"] > 0
    assert_same_outputs(sync["rounds"][0], baseline)


def test_layerwise_long_hits_load_off_the_step(tmp_path, model, baseline, pool):
    """Layerwise with ``async_load_min_tokens: 100``: the two hits of 128 and 159 tokens wait in
    WAITING_FOR_REMOTE_KVS and load on the off-step loader, the 96-token hit loads in the step.
    On the batched path (its device ops on CPU here), which queues every copy of an off-step
    load at once and is polled; the host path's off-step loads are the test above's."""
    copy_path = "batched"
    kv = kv_config(pool.socket, local={"start": "never"}, copy_path=copy_path)
    run_engine(tmp_path, model, [prompts()], kv)  # computes and saves
    extra = {**kv["kv_connector_extra_config"], "async_load_min_tokens": 100}
    r = run_engine(tmp_path, model, [prompts()], {**kv, "kv_connector_extra_config": extra})
    assert r["copy_path"] == copy_path
    assert [o["num_cached_tokens"] for o in r["rounds"][0]] == [96, 128, 159]
    w = r["worker"]
    assert w["async_load_requests"] == 2 and w.get("failed_blocks", 0) == 0, w
    assert_same_outputs(r["rounds"][0], baseline)
