"""Every fault costs time, never tokens, and never the engine.

One engine serves the same prompts round after round; between rounds the injected
fault changes (tests/e2e/faulty_backend.py) or the real pool is stopped, killed and
restarted. Each round's greedy tokens must equal the first round's (which computed
everything), and the counters must show that the fault really fired.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.e2e.conftest import REPO, assert_same_outputs, kv_config, pool_refusals, prompts, run_engine

pytestmark = pytest.mark.e2e
TAMPER = f"{sys.executable} {os.path.join(REPO, 'tests', 'e2e', 'pool_tamper.py')}"
# (fault, counter that must grow in that round, pool hits seen by vLLM: None when the
# lookup hit but the load then failed, which vLLM still reports as cached tokens)
FAULTS = [
    ({"role": "worker", "op": "lease", "kind": "error"}, ("worker", "load_errors"), None),
    ({"role": "worker", "op": "lease", "kind": "latency", "seconds": 0.3},
     ("worker", "loaded_objects"), True),
    ({"role": "worker", "op": "lease", "kind": "partial"}, ("worker", "load_missing"), None),
    ({"role": "worker", "op": "lease", "kind": "misplace"}, ("worker", "load_corrupt"), None),
    ({"role": "worker", "op": "lease", "kind": "short"}, ("worker", "load_corrupt"), None),
    ({"role": "worker", "op": "lease", "kind": "hang"}, ("worker", "load_errors"), None),
    ({"role": "scheduler", "op": "tiers", "kind": "error"}, ("scheduler", "lookup_errors"), False),
    # A hung lookup: each request waits lookup_timeout_s for it, then misses.
    ({"role": "scheduler", "op": "tiers", "kind": "hang"}, ("scheduler", "lookup_timeouts"), False),
    # Every other chunk object reported missing: the hit ends at the first missing chunk.
    ({"role": "scheduler", "op": "tiers", "kind": "partial"}, ("scheduler", "lookup_rpcs"), True),
    ({"role": "worker", "op": "reserve", "kind": "error"}, ("worker", "save_errors"), False),
    ({"role": "worker", "op": "commit", "kind": "drop", "after": 0}, ("worker", "save_errors"), False),
]


def test_fault_matrix_recomputes_with_correct_tokens(tmp_path, model, pool):
    fault_file = tmp_path / "fault.json"
    os.environ["ASCEND_STORE_TEST_FAULT"] = str(fault_file)  # inherited by the engine
    # A rejected load removes the chunk's objects (so it is republished): after such a fault
    # one clean round saves them again before the next fault needs them.
    steps: list[tuple | None] = []
    for entry in FAULTS:
        steps.append(entry)
        if entry[1][1] == "load_corrupt":
            steps.append(None)
    try:
        between, last = [], None
        for step in steps:
            if step is None:
                between.append(f"rm -f {fault_file}")
                continue
            fault = step[0]
            # Save faults need something to save: empty the pool first.
            clear = "".join(f"{TAMPER} remove {pool.socket} basic:{i} && "
                            for i in range(3)) if fault["op"] in ("reserve", "commit") else ""
            # A hung lookup ends after the round (requests do not wait for it): its failure
            # opens the breaker then, for its second backoff (1 s), which the next round waits out.
            pause = 2.5 if last is not None and last["op"] == "tiers" and last["kind"] == "hang" else 1
            between.append(f"{clear}echo '{json.dumps(fault)}' > {fault_file} && sleep {pause}")
            last = fault
        # Clean: once the breaker's backoff (at most 5 s) has passed, save again, then hit.
        between += [f"rm -f {fault_file} && sleep 6", None]
        kv = kv_config(pool.socket, backend="tests.e2e.faulty_backend:FaultyBackend", timeout_s=1.0,
                       lookup_cache={"enabled": False}, local={"start": "never"})
        rounds = [prompts()] * (len(steps) + 3)
        r = run_engine(tmp_path, model, rounds, kv, between=between)
    finally:
        os.environ.pop("ASCEND_STORE_TEST_FAULT")
    first = r["rounds"][0]
    assert all(o["num_cached_tokens"] == 0 for o in first)
    for i, step in enumerate(steps, start=1):
        assert_same_outputs(r["rounds"][i], first)
        before, after = r["per_round"][i - 1], r["per_round"][i]
        if step is None:  # the heal round recomputes what the fault removed and saves it
            assert after["worker"]["saved_objects"] > before["worker"]["saved_objects"], steps[i - 2]
            continue
        fault, (side, counter), hits = step
        assert after[side].get(counter, 0) > before[side].get(counter, 0), (fault, counter)
        if hits is None:
            assert after[side]["failed_blocks"] > before[side].get("failed_blocks", 0), fault
        else:
            assert any(o["num_cached_tokens"] for o in r["rounds"][i]) == hits, fault
    assert [o["num_cached_tokens"] for o in r["rounds"][-1]] == [96, 128, 159]
    assert_same_outputs(r["rounds"][-1], first)


def test_pool_stopped_killed_and_restarted_engine_reconnects(tmp_path, model, pool):
    pid_of = f"$(cat {tmp_path}/pid)"
    between = [
        f"{sys.executable} -m ascend_store.ops.cli pool status --socket {pool.socket} | "
        f"{sys.executable} -c 'import json,sys; print(json.load(sys.stdin)[\"pid\"])' > {tmp_path}/pid"
        f" && kill -STOP {pid_of}",                      # round 1: the pool hangs
        f"kill -CONT {pid_of} && {TAMPER} restart {pool.socket} && sleep 1",  # round 2: new, empty pool
        None,                                           # round 3: hits from the new pool
    ]
    kv = kv_config(pool.socket, timeout_s=1.0, local={"start": "never"})
    r = run_engine(tmp_path, model, [prompts()] * 4, kv, between=between)
    first = r["rounds"][0]
    for out in r["rounds"][1:]:
        assert_same_outputs(out, first)
    assert all(o["num_cached_tokens"] == 0 for o in r["rounds"][1])  # hung pool: recompute
    assert all(o["num_cached_tokens"] == 0 for o in r["rounds"][2])  # restarted pool is empty
    assert [o["num_cached_tokens"] for o in r["rounds"][3]] == [96, 128, 159]
    assert pool_refusals(r["per_round"][1]["scheduler"]) > 0
