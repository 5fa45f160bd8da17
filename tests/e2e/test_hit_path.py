"""The hit path in real vLLM engines (CPU): the default 256-token chunk objects with
vLLM's prefix caching on, a device-cache hit that ends inside an object, and a prompt's
tail stored as a shorter object so at most one block is recomputed."""

from __future__ import annotations

import random

import pytest

from tests.e2e.conftest import HYBRID_BLOCK, Pool, assert_same_outputs, hybrid_prompts, kv_config, run_engine
from tests.e2e.models import build_hybrid, build_mla

pytestmark = pytest.mark.e2e
# vLLM's CPU attention takes block sizes in multiples of 32 only; its MLA kernel takes 16
# only, so the block-16 case runs on a tiny DeepSeek-V2-style MLA model.
BLOCK32 = dict(block_size=32, prefix_caching=True)


def _kv(pool, **extra):
    return kv_config(pool.socket, chunk_size=256, local={"start": "never"}, **extra)  # the default


def test_tail_of_a_1502_token_prompt_comes_from_the_pool(tmp_path, model, pool):
    """1,502 tokens, block 32: 5 chunks of 256 and a 6-block tail object, so a fresh
    engine gets 1,472 tokens from the pool (all 46 whole blocks) and recomputes 30 (the
    partial block); whole chunks alone would have given 1,280."""
    rng = random.Random(1502)
    prompt = [[rng.randrange(2, 500) for _ in range(1502)]]
    baseline = run_engine(tmp_path, model, [prompt], **BLOCK32)["rounds"][0]
    a = run_engine(tmp_path, model, [prompt], _kv(pool), **BLOCK32)
    assert a["worker"]["saved_objects"] == 5 + 1
    assert_same_outputs(a["rounds"][0], baseline)
    b = run_engine(tmp_path, model, [prompt], _kv(pool), **BLOCK32)
    assert b["rounds"][0][0]["num_cached_tokens"] == 1472
    assert b["worker"]["failed_blocks"] == 0
    assert_same_outputs(b["rounds"][0], baseline)


def test_tail_of_a_1502_token_prompt_at_block_16(tmp_path, pool):
    """(45 s) A prompt that is no multiple of the chunk: 1,502 tokens, block 16 (vLLM CPU's MLA kernel), a
    fresh engine gets 1,488 tokens (all 93 whole blocks: 5 chunks and a 13-block tail) from
    the pool and recomputes 14. Same greedy tokens as the engine that computed everything;
    logprobs within 0.1, not 1e-4: vLLM CPU's MLA runs the 14 tokens after a cached context
    through another kernel path than a whole-prompt prefill (bf16), so they differ by up to
    0.07 even with the right KV (the 1e-4 comparison is the block-32 test above)."""
    rng = random.Random(1502)
    prompt = [[rng.randrange(2, 500) for _ in range(1502)]]
    job = dict(dtype="bfloat16", engine_args={"max_num_seqs": 1})
    a = run_engine(tmp_path, build_mla(), [prompt], _kv(pool), **job)  # computes, saves
    assert a["worker"]["saved_objects"] == 5 + 1 and a["rounds"][0][0]["num_cached_tokens"] == 0
    b = run_engine(tmp_path, build_mla(), [prompt], _kv(pool), **job)
    assert b["rounds"][0][0]["num_cached_tokens"] == 1488
    assert b["worker"]["failed_blocks"] == 0
    assert_same_outputs(b["rounds"][0], a["rounds"][0], tol=0.1)


@pytest.mark.parametrize("copy_path, early", [("per_block", False), ("batched", False), ("batched", True)],
                         ids=["per_block", "batched", "batched-from-schedule"])
def test_device_hit_ending_inside_an_object(tmp_path, model, pool, copy_path, early):
    """Round 1 computes a 3-block prefix; round 2's prompt extends it: vLLM's device
    cache serves 3 blocks, the pool the rest of the first chunk object from page 3 on and
    the chunks after it (saved by another engine). ``early``: the loads start as a copy
    engine's do, when the scheduler hands the step over (connector.py), before vLLM's
    runner prepares its inputs and calls the worker's hooks."""
    rng = random.Random(7)
    long = [rng.randrange(2, 500) for _ in range(700)]
    rounds = [[long[:100]], [long]]
    baseline = run_engine(tmp_path, model, rounds, **BLOCK32)["rounds"]
    run_engine(tmp_path, model, [[long]], _kv(pool, copy_path=copy_path), **BLOCK32)  # saves 2 chunks + tail
    r = run_engine(tmp_path, model, rounds, _kv(pool, copy_path=copy_path), start_early=early, **BLOCK32)
    assert r["copy_path"] == copy_path
    # 21 whole blocks: 3 from the device cache, 18 from the pool (2 chunks, a 5-block tail)
    assert r["rounds"][1][0]["num_cached_tokens"] == 672
    assert r["per_round"][1]["scheduler"]["hit_tokens"] == 672 - 96
    assert r["worker"]["failed_blocks"] == 0
    assert len(r["load_step_layers"]) == 1  # one step loads
    assert r["worker"].get("loads_started_at_schedule", 0) == early
    for got, want in zip(r["rounds"], baseline):
        assert_same_outputs(got, want)


def test_hybrid_hit_under_a_long_prefill_on_the_batched_path(tmp_path):
    """(~90 s) Qwen3-Next, batched copy path: a fresh engine's prompt has one chunk in the
    pool and 600 new tokens computed in the same step (>= 512: each batch of layers is
    queued from the wait of the layer before it, loads.py; attention and state layers
    are batches of their own). Every layer must be waited for and every block land: no
    failed block, no timeout, the same tokens and logprobs as without the pool."""
    model = build_hybrid("qwen3_next")
    engine = dict(dtype="bfloat16", prefix_caching=True, block_size=None, stubs=True)
    rng = random.Random(600)
    prefix = [rng.randrange(2, 500) for _ in range(2 * HYBRID_BLOCK)]
    prompt = [prefix + [rng.randrange(2, 500) for _ in range(600)]]
    baseline = run_engine(tmp_path, model, [prompt], **engine)["rounds"][0]
    pool = Pool(str(tmp_path / "pool" / "pool.sock")).start()
    try:
        run_engine(tmp_path, model, [[prefix + [7]]], _kv(pool, copy_path="batched"), **engine)  # one chunk
        r = run_engine(tmp_path, model, [prompt], _kv(pool, copy_path="batched"), **engine)
    finally:
        pool.stop()
    assert r["copy_path"] == "batched"
    assert r["rounds"][0][0]["num_cached_tokens"] == 2 * HYBRID_BLOCK
    assert r["worker"]["failed_blocks"] == 0 and r["worker"].get("load_timeouts", 0) == 0
    assert_same_outputs(r["rounds"][0], baseline)


def test_hybrid_default_chunk_size(tmp_path):
    """Qwen3-Next with two 128-token blocks per chunk object (attention and state groups
    alike), prefix caching on: a fresh engine hits the first chunk of prompts 0 and 1."""
    model = build_hybrid("qwen3_next")
    engine = dict(dtype="bfloat16", prefix_caching=True, block_size=None, stubs=True)
    baseline = run_engine(tmp_path, model, [hybrid_prompts()], **engine)["rounds"][0]
    pool = Pool(str(tmp_path / "pool" / "pool.sock")).start()
    try:
        run_engine(tmp_path, model, [hybrid_prompts()], _kv(pool), **engine)
        r = run_engine(tmp_path, model, [hybrid_prompts()], _kv(pool), **engine)
    finally:
        pool.stop()
    assert [o["num_cached_tokens"] for o in r["rounds"][0]] == [2 * HYBRID_BLOCK, 2 * HYBRID_BLOCK, 0]
    assert r["worker"]["failed_blocks"] == 0
    assert_same_outputs(r["rounds"][0], baseline)
