"""How far ahead of the forward the worker queues a load's batches (loads.py,
``device_work.queue_window``), on the batched copy path with a real local pool.

A full hit (a step computing few tokens) queues every batch when the step's loads start
(on an accelerator ``handle_preemptions``, the runner's first call of a step; else
``start_load_kv``): its
forward hides nothing. A step computing many tokens queues the first layer's batch there
and each next one from the wait of the layer before it, so the forward's first kernel is
not held back by the host work of every batch. Either way every block lands. On CPU the
copies are torch ops and no event exists, so this shows the order of the host's calls,
not the overlap on a device (benchmarks/layerwise.py measures that).
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from ascend_store.common.config import StoreConfig
from ascend_store.common.metadata import ChunkLoad, ChunkSave, StepMetadata
from ascend_store.device import device_path
from ascend_store.worker.pool_worker import PoolWorker

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from worker_host import engine_parts  # noqa: E402

LAYERS, BLOCK = 4, 16
CHUNK_BLOCKS = 256 // BLOCK


@pytest.mark.parametrize("early", [False, True], ids=["host", "copy-engine"])
@pytest.mark.parametrize("new_tokens, at_start", [(1, LAYERS), (2048, 1)])
def test_a_long_step_queues_each_batch_from_the_wait_before_it(pool, monkeypatch, new_tokens, at_start,
                                                              early):
    monkeypatch.setattr(device_path, "BATCH_BYTES", 1)  # every layer a batch of its own
    # On CPU the loads start in start_load_kv; where a copy engine runs (forced here, as
    # on an accelerator) they start in handle_preemptions, and only once a step.
    monkeypatch.setattr(PoolWorker, "starts_early", lambda self: early)
    worker, caches, src, dst, chunks = _worker_with_two_saved_chunks(pool)

    load = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))],
                        new_tokens=new_tokens)
    steps = worker.counters.total["steps"]
    worker.handle_preemptions(load)  # vLLM's runner calls it first in a step
    early_job = worker.loader.job
    assert (early_job is not None) == early
    worker.start_load_kv(load)  # the same step: nothing starts twice
    job = worker.loader.job
    assert job is early_job or not early
    job.future.result(30)  # the lease and the plan run on the load thread
    assert len(job.todo) == LAYERS  # one batch per layer
    assert worker.counters.total["steps"] == steps + 1
    queued = [job.next]
    for name in worker.order:
        worker.wait_for_layer_load(name)
        queued.append(job.next)
    assert worker.get_block_ids_with_load_errors() == set()
    # Queued at the start, then after each layer's wait (the forward reads layer i then).
    assert queued == ([LAYERS] * (LAYERS + 1) if at_start == LAYERS else [1, 2, 3, 4, 4])
    for name, cache in caches.items():
        assert torch.equal(cache[:, dst], cache[:, src]), name
    worker.shutdown()


def _worker_with_two_saved_chunks(pool, device: str = "cpu", **extra):
    """A worker on the batched path whose pool holds two chunks saved from ``src``; loads go
    to ``dst``."""
    vllm_config, kv_cache_config, caches = engine_parts(LAYERS, 2, 64, BLOCK, 4 * CHUNK_BLOCKS + 1)
    caches = {n: c.to(device) for n, c in caches.items()}
    cfg = StoreConfig.parse({"copy_path": "batched", "local": {"socket": pool.socket, "start": "never"},
                             **extra})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    worker.register_kv_caches(caches)
    src = list(range(1, 2 * CHUNK_BLOCKS + 1))
    dst = list(range(2 * CHUNK_BLOCKS + 1, 4 * CHUNK_BLOCKS + 1))
    chunks = lambda ids: [ids[c * CHUNK_BLOCKS:(c + 1) * CHUNK_BLOCKS] for c in range(2)]  # noqa: E731
    save = StepMetadata(saves=[ChunkSave("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(src))],
                        commit_now=True)  # published when wait_for_save returns
    for name in worker.order:
        worker.save_kv_layer(name, save)
    worker.wait_for_save(save)
    return worker, caches, src, dst, chunks



@pytest.mark.parametrize("early", [False, True], ids=["host", "copy-engine"])
def test_a_layerwise_load_the_forward_never_waited_for_is_recomputed(pool, monkeypatch, early):
    # A full CUDA/ACL graph's replay runs the forward without the per-layer hooks (a vLLM
    # that ignores requires_piecewise_for_cudagraph): its tokens read blocks before they
    # landed, so every block of the step's loads is reported and vLLM recomputes them.
    monkeypatch.setattr(PoolWorker, "starts_early", lambda self: early)
    worker, caches, src, dst, chunks = _worker_with_two_saved_chunks(pool)
    load = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))],
                        new_tokens=1)
    worker.handle_preemptions(load)
    worker.start_load_kv(load)
    worker.wait_for_save(load)  # no wait_for_layer_load in between
    assert worker.get_block_ids_with_load_errors() == set(dst)
    # The next step's loads, waited for layer by layer as the forward reads them, land.
    load = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))],
                        new_tokens=1)
    worker.handle_preemptions(load)
    worker.start_load_kv(load)
    for name in worker.order:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(load)
    assert worker.get_block_ids_with_load_errors() == set()
    worker.shutdown()


@pytest.mark.parametrize("early", [False, True], ids=["host", "copy-engine"])
def test_a_full_graph_step_loads_before_the_forward_and_saves_after_it(pool, monkeypatch, early):
    # A step the scheduler marks ``full_graph`` (vLLM may replay one full CUDA/ACL graph for
    # it, whose replay calls no per-layer hook): its loads have landed, or are awaited by
    # the forward's stream, when start_load_kv returns, and its saves are queued after the
    # forward by wait_for_save. Unmarked, the same calls lose both (the test above).
    monkeypatch.setattr(PoolWorker, "starts_early", lambda self: early)
    worker, caches, src, dst, chunks = _worker_with_two_saved_chunks(pool)
    for cache in caches.values():
        cache[:, dst] = 0
    saved = f"{7:032x}"
    step = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))],
                        saves=[ChunkSave("s", 0, saved, src[:CHUNK_BLOCKS])], new_tokens=1,
                        commit_now=True, full_graph=True)
    worker.handle_preemptions(step)
    worker.start_load_kv(step)
    for name, cache in caches.items():  # what the forward reads (CPU copies run in the call)
        assert torch.equal(cache[:, dst], cache[:, src]), name
    worker.wait_for_save(step)  # no wait_for_layer_load or save_kv_layer in between
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.counters.total["loads_before_forward"] == 1
    for cache in caches.values():
        cache[:, dst] = 0
    load = StepMetadata(loads=[ChunkLoad("r", 0, saved, dst[:CHUNK_BLOCKS])], new_tokens=1, full_graph=True)
    worker.handle_preemptions(load)
    worker.start_load_kv(load)
    worker.wait_for_save(load)
    assert worker.get_block_ids_with_load_errors() == set()
    for name, cache in caches.items():
        assert torch.equal(cache[:, dst[:CHUNK_BLOCKS]], cache[:, src[:CHUNK_BLOCKS]]), name
    worker.shutdown()


def test_loads_start_when_the_scheduler_hands_the_step_over(pool, monkeypatch):
    # Where a copy engine runs, the scheduler of the same process hands each step over as
    # it builds it (connector.py): the last step's saves drain and the loads start then,
    # before vLLM's runner prepares its inputs; its hooks later start nothing again.
    monkeypatch.setattr(PoolWorker, "starts_early", lambda self: True)
    worker, caches, src, dst, chunks = _worker_with_two_saved_chunks(pool)
    save = StepMetadata(saves=[ChunkSave("s", 0, f"{9:032x}", src[:CHUNK_BLOCKS])])
    for name in worker.order:
        worker.save_kv_layer(name, save)
    worker.wait_for_save(save)  # its wait for the copies is deferred to the next step
    drains, steps = worker.counters.total["deferred_drains"], worker.counters.total["steps"]
    for cache in caches.values():
        cache[:, dst] = 0  # what the blocks hold after the step comes from its load
    load = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))],
                        new_tokens=1)
    worker.start_at_schedule(load)
    job = worker.loader.job
    assert job is not None and worker.counters.total["deferred_drains"] == drains + 1
    worker.handle_preemptions(load)
    worker.start_load_kv(load)
    assert worker.loader.job is job and worker.counters.total["steps"] == steps + 1
    for name in worker.order:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(load)
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.counters.total["loads_started_at_schedule"] == 1
    for name, cache in caches.items():
        assert torch.equal(cache[:, dst], cache[:, src]), name
    worker.shutdown()


def test_the_hand_over_goes_to_the_one_worker_of_its_engine(pool):
    # connector.py pairs the halves of one engine by engine_id. Two live engines of one
    # process that share it (one KVTransferConfig object passed to both) get no hand-over:
    # one engine's scheduler must never start loads in the other's KV cache.
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from ascend_store import connector

    vllm_config, kv_cache_config, _ = engine_parts(LAYERS, 2, 64, BLOCK, 4 * CHUNK_BLOCKS + 1)
    vllm_config.kv_transfer_config = SimpleNamespace(
        kv_role="kv_both", engine_id="engine-a",
        kv_connector_extra_config={"local": {"socket": pool.socket, "start": "never"}})
    worker_role = lambda: connector.AscendStoreConnector(vllm_config, KVConnectorRole.WORKER,  # noqa: E731
                                                         kv_cache_config)
    handed = []

    def scheduler_role():
        c = connector.AscendStoreConnector.__new__(connector.AscendStoreConnector)
        c.engine_id, c.scheduler = "engine-a", SimpleNamespace(build_connector_meta=lambda out: out)
        return c

    first = worker_role()
    first.worker.start_at_schedule = handed.append
    scheduler_role().build_connector_meta("step 1")
    assert handed == ["step 1"]
    first.shutdown()
    scheduler_role().build_connector_meta("step 2")  # its worker is gone: nobody gets it
    assert handed == ["step 1"]
    second, third = worker_role(), worker_role()
    second.worker.start_at_schedule = third.worker.start_at_schedule = handed.append
    scheduler_role().build_connector_meta("step 3")
    assert handed == ["step 1"]
    second.shutdown()
    third.shutdown()


def test_an_off_step_load_on_the_batched_path_is_reported_once_its_copies_have_run(pool, monkeypatch):
    """Layerwise, an off-step load (async_load_min_tokens) queues all its copies at once and
    ``get_finished`` only polls their events: while one has not run, the request is not
    reported (nothing on the step's thread waits for the device); once all have, it is, with
    the blocks loaded. The events' state is set from here (on CPU every copy has run)."""
    worker, caches, src, dst, chunks = _worker_with_two_saved_chunks(pool, async_load_min_tokens=1)
    for cache in caches.values():
        cache[:, dst] = 0
    ran = threading.Event()
    dev = worker.ctx.device_path.dev
    polled = []
    monkeypatch.setattr(dev, "done", lambda event: polled.append(event) or ran.is_set())
    step = StepMetadata(async_loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))])
    worker.handle_preemptions(step)
    worker.start_load_kv(step)
    job = worker.async_loads._pending[0].job
    job.future.result(timeout=30)  # leased, planned and every copy queued
    assert job.next == len(job.todo) and job.queued
    for _ in range(3):  # steps go on; the request waits
        assert worker.get_finished() == (None, None)
    assert polled
    ran.set()
    assert worker.get_finished() == (None, {"r"})
    assert worker.get_block_ids_with_load_errors() == set()
    for name, cache in caches.items():
        assert torch.equal(cache[:, dst], cache[:, src]), name
    worker.shutdown()
