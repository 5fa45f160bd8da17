"""Hybrid models (Gated-DeltaNet + full attention) against real vLLM engines.

Tiny random bf16 Qwen3-Next and Qwen3.5 models (tests/e2e/models.py): layers 0 and 2
are GDN (recurrent state), 1 and 3 full attention; vLLM picks 128-token blocks and
align mode. Every engine is a new process, so its hits can only come from the pool.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.e2e.conftest import (
    HYBRID_BLOCK,
    REPO,
    Pool,
    assert_same_outputs,
    hybrid_prompts,
    kv_config,
    run_engine,
)
from tests.e2e.models import build_hybrid

pytestmark = pytest.mark.e2e
TAMPER = f"{sys.executable} {os.path.join(REPO, 'tests', 'e2e', 'pool_tamper.py')}"
STATE_GROUP = "g0"  # the chunk objects of the state layers' group (vLLM groups layer 0's type first)
ENGINE = dict(dtype="bfloat16", prefix_caching=True, block_size=None, stubs=True)
# Pool hits of hybrid_prompts(): 2 blocks (the state after block 2 exists: vLLM's aligned
# prefill split ends a step there), the same for the prompt sharing them, 1 block.
HITS = [2 * HYBRID_BLOCK, 2 * HYBRID_BLOCK, HYBRID_BLOCK]
KINDS = ["qwen3_next", "qwen3_5"]


class Filled:
    """A standalone pool holding what one engine saved, plus the no-connector baseline."""

    def __init__(self, tmp, kind):
        self.model = build_hybrid(kind)
        self.pool = Pool(str(tmp / "pool" / "pool.sock")).start()
        self.tmp = tmp
        self.baseline = run_engine(tmp, self.model, [hybrid_prompts()], **ENGINE)["rounds"][0]
        self.saver = run_engine(tmp, self.model, [hybrid_prompts()], self.kv(), **ENGINE)

    def kv(self, **extra):
        return kv_config(self.pool.socket, local={"start": "never"}, **extra)


@pytest.fixture(scope="module", params=KINDS)
def filled(request, tmp_path_factory):
    f = Filled(tmp_path_factory.mktemp(request.param), request.param)
    yield f
    f.pool.stop()


def test_saver_computes_everything_and_publishes_state(filled):
    # An empty pool: only vLLM's own device cache hits (prompt 1 reuses prompt 0's blocks).
    assert filled.saver["worker"].get("loaded_objects", 0) == 0
    assert_same_outputs(filled.saver["rounds"][0], filled.baseline)
    # One chunk object (both attention layers) per full prompt chunk (3), and one (both GDN
    # layers' state) at each of the 2 chunk boundaries where a prefill step ended (after
    # 256 tokens of prompt 0, 128 of prompt 2).
    assert filled.saver["worker"]["saved_objects"] == 3 + 2


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
def test_fresh_engine_hits_state_and_matches_baseline(filled, layerwise):
    r = run_engine(filled.tmp, filled.model, [hybrid_prompts()], filled.kv(use_layerwise=layerwise),
                   **ENGINE)
    got = r["rounds"][0]
    assert [o["num_cached_tokens"] for o in got] == HITS
    assert_same_outputs(got, filled.baseline)  # greedy tokens and their logprobs
    w = r["worker"]
    assert w["loaded_objects"] > 0 and w["failed_blocks"] == 0
    assert w["deferred_state_copies"] > 0  # vLLM's state copy ran after the state landed
    if layerwise:
        # Every layer, GDN and full attention, waited for its load in each loading step,
        # and every forward step made one wait and one save per layer.
        assert r["load_step_layers"] and set(r["load_step_layers"]) == {r["layers"]} == {4}
        assert set(map(tuple, r["step_hooks"])) == {(4, 4)}


def test_state_copy_before_the_load_gives_wrong_tokens(filled):
    """The deferral is what makes the hit right: with it off, vLLM's align-mode copy
    reads the state block before the pool has written it."""
    r = run_engine(filled.tmp, filled.model, [hybrid_prompts()], filled.kv(defer_state_copy=False),
                   **ENGINE)
    got = r["rounds"][0]
    assert [o["num_cached_tokens"] for o in got] == HITS
    assert r["worker"].get("deferred_state_copies", 0) == 0
    assert any(o["token_ids"] != b["token_ids"] or o["logprobs"] != b["logprobs"]
               for o, b in zip(got, filled.baseline))


def test_corrupt_or_missing_state_recomputes(tmp_path):
    """Round 2 loads a state object with flipped bytes: the request is preempted and
    recomputed (vLLM cannot map block failures of multi-group models itself). Round 3
    hits the republished state. Before round 4 prompt 2's state objects are removed; the
    scheduler's hit cache still says they are there, so the load finds them missing:
    the same preempt-and-recompute path."""
    model = build_hybrid("qwen3_next")
    baseline = run_engine(tmp_path, model, [hybrid_prompts()], **ENGINE)["rounds"][0]
    pool = Pool(str(tmp_path / "pool" / "pool.sock")).start()
    try:
        between = [f"{TAMPER} flip {pool.socket} hybrid:0 {STATE_GROUP}", None,
                   f"{TAMPER} remove {pool.socket} hybrid:2 {STATE_GROUP}"]
        r = run_engine(tmp_path, model, [hybrid_prompts()] * 4,
                       kv_config(pool.socket, local={"start": "never"}), between=between,
                       reset_between_rounds=True, **ENGINE)
    finally:
        pool.stop()
    for out in r["rounds"]:
        assert_same_outputs(out, baseline)
    r2 = r["per_round"][1]["worker"]
    assert r2["load_corrupt"] > 0 and r2["failed_blocks"] > 0
    assert "checksum mismatch" in r["log"] and "recomputing them" in r["log"]
    assert [o["num_cached_tokens"] for o in r["rounds"][2]] == HITS
    r3, r4 = r["per_round"][2]["worker"], r["per_round"][3]["worker"]
    assert r4.get("load_missing", 0) > r3.get("load_missing", 0)
    assert r4["failed_blocks"] > r3["failed_blocks"]
    assert r["worker"]["load_corrupt"] == r2["load_corrupt"]  # nothing corrupt after round 2
