"""A host-path load the forward gave up on (``load_timeout_s``) writes no block after the
step reported its blocks failed: vLLM may recompute into them, or hand them to another
request, as soon as it reads the report.

The real worker and ``Loader`` on a real local pool; the only stand-in is a slow layer
copy, installed from here: it holds its write until the step has reported (or at most
``HOLD_S``), which is what a load thread that lost the cores to the forward does.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ascend_store.common.metadata import ChunkLoad, StepMetadata
from ascend_store.worker import host_loads
from tests.unit.test_load_queue import _worker_with_two_saved_chunks

TIMEOUT_S = 0.05  # load_timeout_s: the forward's first wait gives up after this
HOLD_S = 1.5  # longest a held copy waits for the report; far beyond the waits' 5 x TIMEOUT_S


@pytest.mark.parametrize("codec, copy", [("raw", "scatter_pages"), ("int8", "decode_object")])
def test_a_load_given_up_writes_no_block_after_the_report(pool, monkeypatch, codec, copy):
    worker, caches, src, dst, chunks = _worker_with_two_saved_chunks(
        pool, copy_path="per_block", codec=codec, load_timeout_s=TIMEOUT_S)
    for cache in caches.values():
        cache[:, dst] = 0
    reported = threading.Event()
    real = getattr(host_loads, copy)  # the raw parts' scatter, or an int8 object's decode

    def held(*args, **kwargs):
        reported.wait(HOLD_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(host_loads, copy, held)
    load = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))],
                        new_tokens=1)
    worker.handle_preemptions(load)
    worker.start_load_kv(load)
    job = worker.loader.job
    for name in worker.order:  # the forward: the first wait times out, the others return
        worker.wait_for_layer_load(name)
    worker.wait_for_save(load)
    failed = worker.get_block_ids_with_load_errors()
    at_report = {n: c[:, dst].clone() for n, c in caches.items()}
    reported.set()
    job.future.result(timeout=30)  # the load thread is done with the job
    worker.shutdown()
    assert failed == set(dst)
    for name, cache in caches.items():
        assert torch.equal(cache[:, dst], at_report[name]), f"{name} written after the report"
    # One give-up: the forward's later waits did not wait out the timeout again.
    assert worker.counters.total["load_timeouts"] == 1
