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
import time

from ascend_store.common.config import StoreConfig
from ascend_store.common.metadata import ChunkSave, StepMetadata
from ascend_store.worker.pool_worker import PoolWorker

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from worker_host import engine_parts  # noqa: E402

BLOCK, CHUNK_BLOCKS = 16, 256 // 16


def _save_step(worker, chunk: int, commit_now: bool) -> StepMetadata:
    blocks = list(range(1 + chunk * CHUNK_BLOCKS, 1 + (chunk + 1) * CHUNK_BLOCKS))
    meta = StepMetadata(saves=[ChunkSave("r", 0, f"{chunk:032x}", blocks)], commit_now=commit_now)
    for name in worker.order:
        worker.save_kv_layer(name, meta)
    return meta


def _batched_worker(pool, **extra) -> PoolWorker:
    vllm_config, kv_cache_config, caches = engine_parts(2, 2, 64, BLOCK, 2 * CHUNK_BLOCKS + 1)
    cfg = StoreConfig.parse({"copy_path": "batched", "local": {"socket": pool.socket, "start": "never"},
                             **extra})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    worker.register_kv_caches(caches)
    return worker


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


def test_a_reserve_the_pool_does_not_answer_is_dropped_not_waited_for(pool, monkeypatch):
    """A hung pool: the next step waits for the save's reserve at most lookup_timeout_s, then
    drops the save; once the pool answers, the reservations go back (nothing leaks)."""
    vllm_config, kv_cache_config, caches = engine_parts(2, 2, 64, BLOCK, 2 * CHUNK_BLOCKS + 1)
    cfg = StoreConfig.parse({"copy_path": "batched", "lookup_timeout_s": 0.2,
                             "local": {"socket": pool.socket, "start": "never"}})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    worker.register_kv_caches(caches)
    gate, real = threading.Event(), worker.backend.reserve_slots

    def hung(keys, sizes):
        gate.wait(60)
        return real(keys, sizes)

    monkeypatch.setattr(worker.backend, "reserve_slots", hung)
    worker.wait_for_save(_save_step(worker, 0, commit_now=False))
    step = threading.Thread(target=worker.handle_preemptions, args=(None,))  # the next step begins
    step.start()
    step.join(5)
    assert not step.is_alive()  # it waited the deadline, not the pool
    gate.set()
    worker.saver._thread.submit(lambda: None).result(10)  # the save thread is done with it
    worker.saver._publisher.submit(lambda: None).result(10)  # and so is the publish thread
    stats = worker.backend.stats()
    assert (stats["reserved"], stats["objects"]) == (0, 0)
    assert worker.counters.total["save_skipped_unanswered"] == 1
    worker.shutdown()


def test_a_reserve_queued_behind_other_work_is_waited_for_not_dropped(pool, monkeypatch):
    """The save thread busy with the last step's commit work (not waiting for the pool): the
    next step waits for this step's reserve as long as that takes, and both steps save."""
    worker = _batched_worker(pool, lookup_timeout_s=0.1)
    real = worker.saver._run_commit

    def slow(job):
        time.sleep(0.5)  # host work before the pool's commit
        return real(job)

    monkeypatch.setattr(worker.saver, "_run_commit", slow)
    worker.wait_for_save(_save_step(worker, 0, commit_now=False))
    worker.handle_preemptions(None)  # the next step: its reserve queues behind that commit
    worker.wait_for_save(_save_step(worker, 1, commit_now=False))
    worker.handle_preemptions(None)
    worker.shutdown()
    assert worker.counters.total["save_skipped_unanswered"] == 0
    assert worker.counters.total["saved_objects"] == 2


def test_a_slow_commit_does_not_hold_the_next_steps_reserve(pool, monkeypatch):
    """The pool takes 0.5 s to commit (slow, not hung: longer than lookup_timeout_s). The
    next step's reserve does not queue behind that commit, so it is answered at once and
    both steps save (a P/D consumer waits for objects that come)."""
    worker = _batched_worker(pool, lookup_timeout_s=0.1)
    real = worker.backend.commit

    def slow(keys):
        time.sleep(0.5)
        return real(keys)

    monkeypatch.setattr(worker.backend, "commit", slow)
    worker.wait_for_save(_save_step(worker, 0, commit_now=False))
    worker.handle_preemptions(None)
    worker.wait_for_save(_save_step(worker, 1, commit_now=False))
    worker.handle_preemptions(None)
    worker.shutdown()
    assert worker.counters.total["save_skipped_unanswered"] == 0
    assert worker.counters.total["saved_objects"] == 2


def test_layers_queued_while_the_save_thread_is_busy_share_one_task(pool, monkeypatch):
    """Layers queued behind a slow reserve go to the save thread as one task; a layer queued
    while that task runs gets a task of its own; every layer part is written either way
    (an object missing one would be aborted, not committed)."""
    layers = 4
    vllm_config, kv_cache_config, caches = engine_parts(layers, 2, 64, BLOCK, 2 * CHUNK_BLOCKS + 1)
    cfg = StoreConfig.parse({"copy_path": "batched", "local": {"socket": pool.socket, "start": "never"}})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    worker.register_kv_caches(caches)
    saver = worker.saver
    reserve_gate, layer_gate, in_layer = threading.Event(), threading.Event(), threading.Event()
    real_reserve, real_layer = worker.backend.reserve_slots, saver._run_save_layer

    def slow_reserve(keys, sizes):
        reserve_gate.wait(60)
        return real_reserve(keys, sizes)

    def held_layer(job, name, after=None):
        if name == worker.order[0] and not in_layer.is_set():
            in_layer.set()
            layer_gate.wait(60)
        real_layer(job, name, after)

    monkeypatch.setattr(worker.backend, "reserve_slots", slow_reserve)
    monkeypatch.setattr(saver, "_run_save_layer", held_layer)

    # Step 1: every layer queued while the reserve is held: one task takes them all.
    meta = StepMetadata(saves=[ChunkSave("r", 0, f"{1:032x}", list(range(1, 1 + CHUNK_BLOCKS)))],
                        commit_now=True)
    for name in worker.order:
        worker.save_kv_layer(name, meta)
    assert len(saver._job.futures) == 2  # the reserve and one task for the layers
    in_layer.set()  # step 1 does not hold its first layer
    layer_gate.set()
    reserve_gate.set()
    worker.wait_for_save(meta)
    assert worker.counters.total["saved_objects"] == 1

    # Step 2: the first layer's task is running when the others are queued.
    in_layer.clear()
    layer_gate.clear()
    meta = StepMetadata(saves=[ChunkSave("r", 0, f"{2:032x}",
                                         list(range(1 + CHUNK_BLOCKS, 1 + 2 * CHUNK_BLOCKS)))],
                        commit_now=True)
    worker.save_kv_layer(worker.order[0], meta)
    assert in_layer.wait(10)
    for name in worker.order[1:]:
        worker.save_kv_layer(name, meta)
    assert len(saver._job.futures) == 3  # the reserve, the running task, one for the rest
    layer_gate.set()
    worker.wait_for_save(meta)
    assert worker.counters.total["saved_objects"] == 2
    assert worker.counters.total.get("save_incomplete", 0) == 0
    worker.shutdown()
