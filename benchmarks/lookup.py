"""Scheduler lookup cost with the block-hit cache on and off, in one run.

A real local pool holds the KV objects (tiny payloads: lookups never touch bytes) of a
shared-prefix workload; each simulated step brings N new requests with the same prefix,
as under prefix-sharing load, and runs vLLM's lookup hook for each one, as vLLM does: a
request not answered yet (None) is asked again at the next step, after the step's
lookups went to the pool (``build_connector_meta``). Reported per step: the time on the
scheduler's thread, the time until every request of the step was answered, and the pool
calls and keys asked.

    python benchmarks/lookup.py [--requests 40] [--tokens 8192] [--shared 0.9] [--layers 32]
                                [--steps 10] [--capacity 4GiB]

tests/unit/test_benchmarks.py runs it small, so it keeps working.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from ascend_store.backends.local.client import LocalBackend
from ascend_store.backends.local.launcher import ping
from ascend_store.common.config import LocalPoolConfig, LookupCacheConfig, StoreConfig
from ascend_store.scheduler.pool_scheduler import PoolScheduler

BLOCK = 128


def fake_vllm(layers: int, block: int = BLOCK):
    """The parts of vLLM's config the connector's halves read, and a real KV cache config
    of one full-attention group (benchmarks/worker_host.py uses it too)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="bench-model", revision=None, dtype="bfloat16"),
        load_config=SimpleNamespace(load_format="dummy"),  # no weight files to fingerprint
        cache_config=SimpleNamespace(block_size=block, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"),
        compilation_config=SimpleNamespace(cudagraph_mode=None), speculative_config=None)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    spec = FullAttentionSpec(block_size=block, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    return vllm_config, KVCacheConfig(0, [], [KVCacheGroupSpec(names, spec)])


def _request(request_id: str, tokens: list[int]):
    """What the scheduler's lookup reads of a vLLM request."""
    return SimpleNamespace(request_id=request_id, prompt_token_ids=tokens, lora_request=None,
                           cache_salt=None, mm_features=[], prompt_embeds=None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shared", type=float, default=0.9)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--capacity", default="4GiB")
    args = ap.parse_args()

    rng = random.Random(0)
    shared = [rng.randrange(50_000) for _ in range(int(args.tokens * args.shared))]
    def prompt():
        return shared + [rng.randrange(50_000) for _ in range(args.tokens - len(shared))]
    steps = [[prompt() for _ in range(args.requests)] for _ in range(args.steps)]

    socket = tempfile.mkdtemp(prefix="ascend-store-lookup-") + "/pool.sock"
    server = subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli", "pool", "serve", "--socket",
                               socket, "--capacity", args.capacity], stderr=subprocess.DEVNULL)
    try:
        while not ping(socket):
            time.sleep(0.05)
        vllm_config, kv_cache_config = fake_vllm(args.layers)
        base = StoreConfig(local=LocalPoolConfig(socket=socket, start="never"))
        # Publish every chunk of every prompt so each lookup is a full hit.
        pub = PoolScheduler(vllm_config, kv_cache_config, base, "kv_both")
        client = LocalBackend(LocalPoolConfig(socket=socket, start="never"), map_arena=False)
        keys = sorted({ks.key(g, h) for prompts in steps for p in prompts
                       for h in pub.request_chain(_request("pub", p))[0] for ks in pub.keyspaces
                       for g in pub.attn_groups})
        for i in range(0, len(keys), 20_000):
            batch = keys[i:i + 20_000]
            client.reserve(batch, [64] * len(batch))
            client.commit(batch)
        pub.shutdown()

        print(f"{args.requests} requests/step x {args.tokens} tokens, {args.shared:.0%} shared, "
              f"{args.layers} layers, block {BLOCK}, {args.steps} steps, {len(keys)} keys in the pool")
        print(f"{'lookup cache':<14}{'ms/step':>10}{'us/1K tok':>11}{'answered ms':>13}{'RPCs/step':>11}"
              f"{'keys asked/step':>17}{'hit tokens ok':>15}")
        rows, all_ok = {}, True
        for enabled in (False, True):
            cfg = replace(base, lookup_cache=LookupCacheConfig(enabled=enabled))
            sched = PoolScheduler(vllm_config, kv_cache_config, cfg, "kv_both")
            before = client.stats()["key_queries"].get("tiers", 0)
            rpcs0 = sched.backend.rpcs
            dt = wall = 0.0  # on the scheduler's thread; until answered
            ok = True
            for s, prompts in enumerate(steps):
                pending = {r: _request(f"{enabled}-{s}-{r}", p) for r, p in enumerate(prompts)}
                t_step = time.perf_counter()
                while pending:  # vLLM's steps, until every request of this one is answered
                    t0 = time.perf_counter()
                    for r, req in list(pending.items()):
                        hit, _ = sched.get_num_new_matched_tokens(req, 0)
                        if hit is None:
                            continue
                        p = req.prompt_token_ids
                        ok &= hit == (len(p) // BLOCK) * BLOCK - (len(p) % BLOCK == 0)
                        sched.request_finished(req)
                        del pending[r]
                    sched.lookups.flush()  # the end of the step's scheduling
                    dt += time.perf_counter() - t0
                    time.sleep(0.0002)  # the rest of an engine step
                wall += time.perf_counter() - t_step
            asked = client.stats()["key_queries"].get("tiers", 0) - before
            n = args.steps
            rows[enabled] = dt / n
            print(f"{'on' if enabled else 'off':<14}{dt / n * 1e3:>10.2f}"
                  f"{dt / (n * args.requests * args.tokens / 1000) * 1e6:>11.1f}{wall / n * 1e3:>13.2f}"
                  f"{(sched.backend.rpcs - rpcs0) / n:>11.1f}{asked / n:>17.0f}{str(ok):>15}")
            sched.shutdown()
            all_ok &= ok
        print(f"cache on / off time per step: {rows[True] / rows[False]:.3f}")
        client.close()
    finally:
        server.terminate()
        server.wait(10)
    if not all_ok:
        sys.exit("some lookups returned the wrong number of hit tokens")


if __name__ == "__main__":
    main()
