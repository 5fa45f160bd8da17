"""The Mooncake backend against real engines and a real Mooncake master (inside a private network
namespace: `make test` runs this file with `unshare -n`)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_same_outputs, kv_config, prompts, run_engine

pytestmark = pytest.mark.e2e


def _kv(svc, **extra):
    return kv_config("/unused", backend="mooncake", timeout_s=2.0,
                     mooncake={"master": svc.params["master"], "global_segment_size": 0,
                               "staging_size": "64MiB"}, **extra)


def test_mooncake_fresh_engine_loads_what_another_saved(tmp_path, model, baseline, mooncake):
    a = run_engine(tmp_path, model, [prompts()], _kv(mooncake))
    assert a["worker"]["saved_objects"] > 0
    assert_same_outputs(a["rounds"][0], baseline)
    b = run_engine(tmp_path, model, [prompts()], _kv(mooncake))
    assert [o["num_cached_tokens"] for o in b["rounds"][0]] == [96, 128, 159]
    assert b["worker"]["failed_blocks"] == 0
    assert_same_outputs(b["rounds"][0], baseline)


def test_mooncake_master_down_at_start_then_killed_mid_run(tmp_path, model, baseline, mooncake):
    # Down at start: the engine starts, serves by recompute, and says so once.
    mooncake.stop_fn()
    r = run_engine(tmp_path, model, [prompts()], _kv(mooncake))
    assert_same_outputs(r["rounds"][0], baseline)
    assert r["log"].count("requests recompute until it is back") == 1
    # Killed mid-run: no hang, every request completes with the right tokens.
    mooncake.start_fn()
    kill = f"pkill -9 -f '[m]ooncake_master.*{mooncake.params['master'].split(':')[1]}'"
    r = run_engine(tmp_path, model, [prompts(), prompts(), prompts()], _kv(mooncake),
                   between=[None, kill])
    assert [o["num_cached_tokens"] for o in r["rounds"][1]] == [96, 128, 159]
    for out in r["rounds"]:
        assert_same_outputs(out, baseline)
    # The outage showed up: lookups failed, or (with the lookup cache answering) loads did.
    last = r["per_round"][2]
    assert last["scheduler"].get("lookup_errors", 0) + last["worker"].get("failed_blocks", 0) > 0
