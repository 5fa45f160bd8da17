"""Per-layer load waits inside a full CUDA graph (graph_waits.py), with a real local pool.

The graph stands in for vLLM's full graph: per layer, the worker's ``wait_for_layer_load``
(what vLLM's attention wrapper calls, here during the capture) and a read of the layer's
blocks. A step marked ``full_graph`` then starts its load without a whole-load wait; the
load stream is held back 50 ms first, so a graph that did not wait per layer reads the
blocks before they land. The control graph, captured without the worker's waits, must
read them unloaded, or this test could not see a missing wait. Needs CUDA and vLLM
(skipped elsewhere); ``make gpu-test`` runs it with the other CUDA-only tests.
"""

from __future__ import annotations

import pytest
import torch

from ascend_store.common.metadata import ChunkLoad, StepMetadata
from tests.unit.test_load_queue import _worker_with_two_saved_chunks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _capture(worker, caches, dst, waits: bool):
    """A graph reading every layer's ``dst`` blocks into static buffers, each read after
    the worker's wait for that layer when ``waits``."""
    idx = torch.tensor(dst, device="cuda")  # a list index would copy from the host in the capture
    out = {n: torch.empty_like(c[:, dst]) for n, c in caches.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for name, cache in caches.items():
            if waits:
                worker.wait_for_layer_load(name)
            out[name].copy_(cache.index_select(1, idx))
    return graph, out


def _marked_step(worker, caches, dst, chunks, graph) -> set[int]:
    for cache in caches.values():
        cache[:, dst] = 0
    step = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))],
                        new_tokens=1, full_graph=True)
    with torch.cuda.stream(worker.device_path.load_stream):
        torch.cuda._sleep(100_000_000)  # ~50 ms: the copies land well after the launch
    worker.handle_preemptions(step)
    worker.start_load_kv(step)
    graph.replay()
    worker.wait_for_save(step)
    failed = worker.get_block_ids_with_load_errors()
    torch.cuda.synchronize()
    return failed


def test_a_full_graph_waits_for_each_layer_of_a_marked_load(pool):
    worker, caches, src, dst, chunks = _worker_with_two_saved_chunks(pool, "cuda", graph_layer_waits=True)
    assert worker.graph_waits is not None and not worker.graph_waits.armed
    graph, out = _capture(worker, caches, dst, waits=True)
    assert worker.graph_waits.armed  # every layer's wait is in the one captured graph
    assert _marked_step(worker, caches, dst, chunks, graph) == set()
    assert worker.counters.total["loads_in_graph"] == 1
    for name, cache in caches.items():
        assert torch.equal(out[name], cache[:, src]), name

    control, unwaited = _capture(worker, caches, dst, waits=False)
    assert _marked_step(worker, caches, dst, chunks, control) == set()
    assert not any(torch.equal(unwaited[n], c[:, src]) for n, c in caches.items())
    assert all(torch.equal(c[:, dst], c[:, src]) for c in caches.values())  # landed, too late
    worker.shutdown()


def test_a_graph_captured_without_the_waits_keeps_the_whole_load_first(pool):
    # No full graph captured the worker's waits (a runner that captures with the connector
    # disabled): a marked step's load lands before the forward, as before graph_waits.py.
    worker, caches, src, dst, chunks = _worker_with_two_saved_chunks(pool, "cuda", graph_layer_waits=True)
    graph, out = _capture(worker, caches, dst, waits=False)
    assert not worker.graph_waits.armed
    assert _marked_step(worker, caches, dst, chunks, graph) == set()
    assert worker.counters.total["loads_before_forward"] == 1
    for name, cache in caches.items():
        assert torch.equal(out[name], cache[:, src]), name
    worker.shutdown()
