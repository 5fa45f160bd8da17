"""Non-blocking loads (``async_load``, whole mode): a pool hit loads off the step.

vLLM's protocol: the scheduler answered ``load_async=True``, so the request waits in
WAITING_FOR_REMOTE_KVS while the running requests keep decoding. A step's loads of such
requests form one job, run by ``loads.py``'s host copy path on this module's own load
thread (moved off the forward's cores). The first step that
finds a job finished reports its requests through ``get_finished`` and, in the same
pass, the blocks of its failed chunks through ``get_block_ids_with_load_errors``, so
vLLM recomputes from the first failed block. A job still running ``load_timeout_s`` after
it started is cancelled: it stops before its next write and all its blocks count as
failed, but its requests are reported only once its thread has let go of their blocks,
since vLLM may give them to another request right after.

On an accelerator (the batched copy path) the load thread leases, plans and queues every
copy of a job on the load stream at once, then waits for them and compares their
checksums itself (the sums come back on a stream of their own, not behind later loads);
``finished`` reports the job's requests once that is done and the copies' events say they
ran, so no call on the step's thread waits on the device. Layerwise
engines load hits of at least ``async_load_min_tokens`` this way, shorter ones in the step.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from ascend_store.common.metadata import ChunkLoad
from ascend_store.worker.loads import Loader, LoadJob
from ascend_store.worker.worker_context import WorkerContext

log = logging.getLogger("ascend_store")


def _off_forward_cores() -> None:
    """A thread inherits its creator's CPU mask, and vLLM's CPU worker pins the forward's
    thread to its OpenMP cores (VLLM_CPU_OMP_THREADS_BIND): a load thread there would take
    turns with the forward on the same core. Move it to the other cores, where there are."""
    try:
        forward = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - forward
        if others:
            os.sched_setaffinity(0, others)
    except (AttributeError, OSError) as exc:  # not Linux, or the cores are not ours (cpuset)
        log.debug("ascend-store: load thread keeps its CPU mask (%s)", exc)


@dataclass
class _Pending:
    job: LoadJob
    req_ids: set[str]
    started: float


class AsyncLoads:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        # Its own thread (a long hit never queues behind a step's load), off the forward's cores.
        self.loader = Loader(ctx, initializer=_off_forward_cores, share=ctx.cfg.async_load_share,
                             in_step=False)
        self._pending: list[_Pending] = []
        self._errors: set[int] = set()

    def start(self, loads: list[ChunkLoad]) -> None:
        job = self.loader.start(loads)
        self.loader.job = None  # jobs are tracked here, several may run
        self._pending.append(_Pending(job, {ld.req_id for ld in loads}, time.monotonic()))

    def finished(self) -> set[str]:
        """Requests whose load is over (landed, failed or cancelled)."""
        done: set[str] = set()
        keep = []
        for p in self._pending:
            if not self.loader.landed(p.job):
                if not p.job.cancelled and time.monotonic() - p.started > self.ctx.cfg.load_timeout_s:
                    self.loader.abandon(p.job, f"not loaded within {self.ctx.cfg.load_timeout_s}s")
                keep.append(p)
                continue
            self._errors |= self.loader.collect(p.job)
            done |= p.req_ids
        self._pending = keep
        self.ctx.counters["async_load_requests"] += len(done)
        return done

    def errors(self) -> set[int]:
        """Failed blocks of the jobs ``finished`` last reported."""
        out, self._errors = self._errors, set()
        return out

    def take_failed_chunks(self) -> list[str]:
        return self.loader.take_failed_chunks()

    def shutdown(self) -> None:
        self.loader.shutdown()
