"""What the worker's next step waits for of a finished step's save (saves.py), with a real
local pool whose ``commit`` is held open (a slow pool).

The next step must not start before the save's copies stop reading the step's blocks (vLLM
may hand them to another request), but it need not wait for the commit: headers and the
pool's ``commit`` go on on the save thread. A step whose reply must not overtake its
objects (``commit_now``: a P/D producer's last prompt step) does wait for the commit.
"""

from __future__ import annotations

import os
import sys
import threading

from ascend_store.config import StoreConfig
from ascend_store.metadata import ChunkSave, StepMetadata
from ascend_store.pool_worker import PoolWorker

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from worker_host import engine_parts  # noqa: E402

BLOCK, CHUNK_BLOCKS = 16, 256 // 16


def _save_step(worker, chunk: int, commit_now: bool) -> StepMetadata:
    blocks = list(range(1 + chunk * CHUNK_BLOCKS, 1 + (chunk + 1) * CHUNK_BLOCKS))
    meta = StepMetadata(saves=[ChunkSave("r", 0, f"{chunk:032x}", blocks)], commit_now=commit_now)
    for name in worker.order:
        worker.save_kv_layer(name, meta)
    return meta


def test_the_next_step_waits_for_the_copies_not_for_the_commit(pool, monkeypatch):
    vllm_config, kv_cache_config, caches = engine_parts(2, 2, 64, BLOCK, 2 * CHUNK_BLOCKS + 1)
    cfg = StoreConfig.parse({"copy_path": "batched", "local": {"socket": pool.socket, "start": "never"}})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    worker.register_kv_caches(caches)
    gate, real = threading.Event(), worker.backend.commit

    def held(keys):
        gate.wait(60)
        return real(keys)

    monkeypatch.setattr(worker.backend, "commit", held)

    worker.wait_for_save(_save_step(worker, 0, commit_now=False))
    step = threading.Thread(target=worker.handle_preemptions, args=(None,))  # the next step begins
    step.start()
    step.join(5)
    assert not step.is_alive()  # it did not wait for the held commit
    assert worker.counters.total["saved_objects"] == 0  # which is still in flight
    gate.set()

    worker.handle_preemptions(None)
    gate.clear()
    reply_step = _save_step(worker, 1, commit_now=True)
    step = threading.Thread(target=worker.wait_for_save, args=(reply_step,))
    step.start()
    step.join(1)
    assert step.is_alive()  # the reply's step waits for its objects' commit
    gate.set()
    step.join(10)
    assert not step.is_alive()
    assert worker.counters.total["saved_objects"] == 2  # both steps' objects, published
    worker.shutdown()
