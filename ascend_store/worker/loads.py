"""The worker's loads: a step's hits from the pool into vLLM's KV cache, layer by layer.

One ``lease`` of the step's chunk objects (one per chunk and KV cache group, every layer
inside: worker_context.py), one numpy pass over every layer part's header (key, layer,
layout, codec, size: admission.py), then the pages move layer by layer. The lease runs on the load
thread, never on the forward's. On accelerators that thread then queues the copies on a
side stream in batches of layers (device_path.py: one plan per step): all of them for a
short step, else the first ones, and the forward's thread queues each later batch from
the ``wait`` of the layer before it (once the plan is there); ``wait`` makes the compute
stream wait on the event of that layer's batch. On CPU the load thread copies layer by
layer, and ``wait`` waits for its layer, at most ``load_timeout_s``: then the load is
given up and its thread stops before its next write (host_loads.py).
Missing or corrupt objects mark their chunk failed; ``errors`` reports their blocks (a
given-up load's once no write of it is under way) and vLLM recomputes them. No failure
in a load ever propagates into the forward.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from ascend_store.backends import BackendUnavailable
from ascend_store.common.metadata import ChunkLoad
from ascend_store.common.transfer import FLAG_WSUM, CorruptObject
from ascend_store.device.device_work import BatchLoad, LayerObjects, QueuedLoad, queue_window
from ascend_store.worker import host_loads
from ascend_store.worker.admission import Admitted, lease, reject
from ascend_store.worker.worker_context import WorkerContext

log = logging.getLogger("ascend_store")


class LoadJob:
    def __init__(self, loads: list[ChunkLoad], layers: list[str]):
        self.loads = loads
        self.waited = False  # the forward waited for one of its layers
        self.unplaced = {j for j, ld in enumerate(loads) if 0 in ld.block_ids}  # has vLLM's null block
        self.events = {name: threading.Event() for name in layers}  # host path: layer landed
        self.device_events: dict[str, object] = {}  # layer -> its batch's event (accelerators)
        self.awaited: object = None  # the event the compute stream waited on last
        self.compute: object = None  # the forward's stream (accelerators), looked up once
        self.window = 0  # layers queued ahead of the forward (accelerators)
        self.queued: list[tuple[QueuedLoad, Admitted]] = []
        self.todo: list[tuple[BatchLoad, Admitted]] = []  # accelerators: batches, model order
        self.first: list[int] = []  # per batch in todo: the rank of its first layer
        self.next = 0  # todo[:next] are queued
        self.arena: torch.Tensor | None = None
        self.leased: list[str] = []
        self.failed: set[int] = set()  # indexes into loads
        self.corrupt: set[int] = set()  # chunks whose objects are removed, so a recompute republishes them
        self.gate = host_loads.WriteGate()  # the host path's writes into the cache
        self.future: Future | None = None
        self.checked = False  # accelerators: its copies' checksums are compared

    @property
    def cancelled(self) -> bool:
        return self.gate.given_up


class Loader:
    def __init__(self, ctx: WorkerContext, initializer=None, share: float = 1.0, in_step: bool = True):
        self.ctx = ctx
        self.in_step = in_step  # the step's forward reads its loads (false: async loads)
        self.job: LoadJob | None = None  # this step's
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ascend-store-load", initializer=initializer)
        self._failed_chunks: set[str] = set()
        self._scratch = host_loads.Scratch(share)  # the load thread's buffer and pace (async_loads.py)

    def start(self, loads: list[ChunkLoad], new_tokens: int = 0) -> LoadJob:
        """``new_tokens``: tokens the step computes (it sets how far copies are queued ahead).
        The lease runs on the load thread on both paths, never on the caller's: on
        accelerators it overlaps the runner's input preparation when the step's loads start
        at the scheduler's hand-over."""
        job = self.job = LoadJob(loads, self.ctx.order if self.ctx.device_path is None else [])
        job.window = queue_window(new_tokens, len(self.ctx.order), self.ctx.cfg.load_window)
        dp = self.ctx.device_path
        if dp is not None:
            # After the compute stream's work queued so far (vLLM's zeroing of new blocks, a
            # last step): recorded here, where that stream is current.
            dp.dev.wait(dp.dev.record(), dp.load_stream)
            job.future = self._thread.submit(self._plan_device_load, job)
        else:
            job.future = self._thread.submit(self._run_load, job)
        return job

    def wait(self, layer_name: str) -> None:
        """Return once ``layer_name`` may be read: its copy landed (CPU) or the compute
        stream waits on it (accelerators)."""
        job = self.job
        if job is None:
            return
        job.waited = True
        ev = job.events.get(layer_name)
        if ev is not None and not job.cancelled and not ev.wait(self.ctx.cfg.load_timeout_s):
            self.abandon(job, f"layer {layer_name} not loaded within {self.ctx.cfg.load_timeout_s}s")
        if self.ctx.device_path is not None:  # the compute stream waits; the host does not
            if not job.future.done() and not job.cancelled and \
                    wait([job.future], timeout=self.ctx.cfg.load_timeout_s).not_done:
                self.abandon(job, f"the lease not answered within {self.ctx.cfg.load_timeout_s}s")
            self._queue_upto(job, self.ctx.rank.get(layer_name, -1) + 1 + job.window)
            done = job.device_events.get(layer_name)
            if done is not job.awaited:  # a batch's later layers: the stream waits already
                self.ctx.device_path.dev.wait(done, self._compute(job))
                job.awaited = done

    def finish(self, job: LoadJob, before_forward: bool = False) -> None:
        """Every layer of ``job`` landed, or is awaited by the compute stream (by the
        forward's, ``before_forward``: so the forward waited for every layer)."""
        job.waited |= before_forward
        if job.future is not None and not job.cancelled and \
                wait([job.future], timeout=self.ctx.cfg.load_timeout_s).not_done:
            self.abandon(job, "load job did not finish")
        if self.in_step and self.ctx.cfg.use_layerwise and not job.cancelled:
            # A layer the forward never waited for read its blocks before they landed: every
            # layer when a full CUDA/ACL graph ran a step not marked ``full_graph`` (its
            # replay runs no hook; pool_scheduler.py predicts which steps vLLM replays).
            skipped = (f"layer {job.todo[job.next][0].layers[0].name}" if job.next < len(job.todo)
                       else None if job.waited else "any layer")
            if skipped:
                self.abandon(job, f"the forward never waited for {skipped} (a full graph ran a "
                                  "step the scheduler did not mark full_graph)")
        if self.ctx.device_path is not None:
            self._queue_upto(job, len(self.ctx.order))
            for event in {id(e): e for e in job.device_events.values()}.values():  # one per batch
                self.ctx.device_path.dev.wait(event, self._compute(job))

    def _compute(self, job: LoadJob):
        """The forward's stream, looked up once per step (a lookup costs ~20 us of Python)."""
        if job.compute is None:
            job.compute = self.ctx.device_path.dev.current()
        return job.compute

    def landed(self, job: LoadJob) -> bool:
        """Whether an off-step job is over without waiting: its lease and plan are done and,
        on an accelerator, every copy it queued has run (its events, polled)."""
        if job.future is not None and not job.future.done():
            return False
        dp = self.ctx.device_path
        return dp is None or all(dp.dev.done(q.done) for q, _ in job.queued)

    def errors(self) -> set[int]:
        """The step's blocks whose load failed (vLLM recomputes them)."""
        job, self.job = self.job, None
        return set() if job is None else self.collect(job)

    def collect(self, job: LoadJob) -> set[int]:
        """``job``'s failed blocks, once it is finished or given up and no write of it is
        under way (its failed chunks are noted)."""
        if job.cancelled:  # no write of it under way, none to come (the device path's queued
            job.gate.fence()  # copies included: finish has the compute stream wait for them)
        self.finish(job)
        if self.ctx.device_path is not None:
            self._check_device_load(job)
        bad = {b for j in job.failed for b in job.loads[j].block_ids}
        self._failed_chunks.update(job.loads[j].chunk_hash for j in job.failed)
        self.ctx.counters["failed_blocks"] += len(bad)
        return bad

    def take_failed_chunks(self) -> list[str]:
        out, self._failed_chunks = sorted(self._failed_chunks), set()
        return out

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    # -- the two paths --------------------------------------------------------------
    def _run_load(self, job: LoadJob) -> None:
        """The host path (a background thread): layer by layer, verify and copy (raw
        parts in a few array ops per layer: host_loads.py) or decode."""
        ctx = self.ctx
        t0 = time.perf_counter()
        try:
            arena, admitted = lease(self.ctx, job)
            host, words = arena.numpy(), host_loads.words_of(arena)
            for name in ctx.order:
                if job.cancelled:
                    break
                g, i = ctx.group_of[name]
                for adm in admitted:
                    if adm.step.fmt.group != g or not len(adm.entries):
                        continue
                    t_layer = time.perf_counter()
                    starts = adm.parts[i, adm.obj]
                    if words is not None and host_loads.batched(ctx.layouts[name], ctx.codecs[name], starts):
                        bad = host_loads.copy_layer(words, host, ctx.layouts[name], adm, i, name, starts,
                                                    job.failed, ctx.cfg.verify_checksum, self._scratch,
                                                    job.gate)
                    else:
                        bad = host_loads.decode_layer(arena, ctx.layouts[name], ctx.codecs[name], adm, i,
                                                      name, job.loads, job.failed, ctx.cfg.verify_checksum,
                                                      job.gate)
                        self._scratch.rest(t_layer)
                    for j, why in bad:
                        reject(self.ctx, job, j, CorruptObject(why))
                job.events[name].set()
        except host_loads.GivenUp:
            pass  # every block of it is failed already
        except Exception as exc:  # the pool is an optimization: never fail the forward
            self._load_failed(job, exc)
        finally:
            for ev in job.events.values():
                ev.set()
            ctx.counters["load_seconds"] += time.perf_counter() - t0
            self._release(job)

    def _plan_device_load(self, job: LoadJob) -> None:
        """The accelerator path, on the load thread: one lease and one header pass for the
        step, then a few batched copies per group on the load stream, the first
        ``job.window`` layers' queued here (every layer's, when that is 0), the others by
        the forward's thread once this is done (``wait``). Checksums are compared at the end
        of the step (``_check_device_load``)."""
        ctx = self.ctx
        t0 = time.perf_counter()
        try:
            arena, admitted = lease(self.ctx, job)
            job.arena = arena
            admitted = [adm for adm in admitted if len(adm.entries)]
            # One group (dense models): its first DMAs go out while the rest is planned.
            early = arena if len(admitted) == 1 else None
            for adm in admitted:
                blocks = [job.loads[j].block_ids for j in adm.entries.tolist()]
                skips = [job.loads[j].skip for j in adm.entries.tolist()]
                stored = np.where(adm.headers["flags"] & FLAG_WSUM, adm.headers["crc"].astype(np.int64), -1)
                o = adm.obj  # [layer, entry] columns, taken once: each layer gets a row
                parts, sizes, stored = adm.parts[:, o], adm.sizes[:, o], stored[:, o]
                layers = [LayerObjects(name, parts[i], sizes[i], blocks, skips, [], stored[i], adm.planner)
                          for i, name in enumerate(adm.step.fmt.layers)]
                job.todo += [(batch, adm) for batch in ctx.device_path.batches(layers, early)]
            job.todo.sort(key=lambda t: ctx.rank[t[0].layers[0].name])
            job.first = [ctx.rank[batch.layers[0].name] for batch, _ in job.todo]
            # Layerwise: the batches of the first ``job.window`` layers now, each later one
            # as the forward reaches the layer ``job.window`` before it (``wait``). Not once
            # the step gave the load up: its blocks may be another request's by then.
            # An off-step load (async_loads.py) has no forward to pace it: all at once.
            with job.gate:
                self._queue_upto(job, job.window if ctx.cfg.use_layerwise and self.in_step
                                 else len(ctx.order))
            if not self.in_step:  # off the step: wait for the copies and check them here,
                # on the load thread, where waiting holds up no step
                self._check_device_load(job)
        except host_loads.GivenUp:
            pass  # every block of it is failed already
        except Exception as exc:
            self._load_failed(job, exc)
        ctx.counters["load_seconds"] += time.perf_counter() - t0

    def _queue_upto(self, job: LoadJob, stop: int) -> None:
        """Queue the copies of the batches whose first layer comes before rank ``stop``."""
        if job.next >= len(job.todo) or job.first[job.next] >= stop:
            return
        t0 = time.perf_counter()
        try:
            while job.next < len(job.todo) and job.first[job.next] < stop:
                batch, adm = job.todo[job.next]
                job.next += 1
                if job.cancelled:
                    continue
                q = self.ctx.device_path.queue_batch(job.arena, batch)
                job.queued.append((q, adm))
                for objs in batch.layers:
                    job.device_events[objs.name] = q.done
        except Exception as exc:
            job.next = len(job.todo)
            self._load_failed(job, exc)
        self.ctx.counters["load_seconds"] += time.perf_counter() - t0

    def _check_device_load(self, job: LoadJob) -> None:
        """Wait for the queued copies and compare their checksums (once per job); then
        release the leases off the step's path (the copies no longer read the arena)."""
        if job.checked:
            return
        job.checked = True
        queued = [q for q, _ in job.queued]
        checked = self.ctx.device_path.check_loads(queued, self.ctx.cfg.verify_checksum)
        for (q, adm), per_layer in zip(job.queued, checked):
            for objs, bad in zip(q.layers, per_layer):
                for e in bad:
                    j = int(adm.entries[e])
                    if j not in job.failed:
                        reject(self.ctx, job, j, CorruptObject(
                            f"{adm.step.keys[adm.obj[e]]} layer {objs.name}: checksum mismatch"))
        self._thread.submit(self._release, job)

    def _load_failed(self, job: LoadJob, exc: Exception) -> None:
        if not isinstance(exc, BackendUnavailable):
            log.exception("KV pool load failed; recomputing")
        self.ctx.counters["load_errors"] += 1
        job.failed.update(range(len(job.loads)))

    def _release(self, job: LoadJob) -> None:
        try:
            if job.leased:
                self.ctx.backend.release(job.leased)
            if job.corrupt:  # the whole chunk object goes: a recompute republishes it
                self.ctx.backend.remove(sorted({k for j in job.corrupt for k in self._keys(job, j)}))
        except BackendUnavailable:
            pass  # the pool drops our leases when their TTL ends

    def abandon(self, job: LoadJob, why: str) -> None:
        log.warning("KV pool load abandoned (%s); recomputing", why)
        self.ctx.counters["load_timeouts"] += 1
        job.failed.update(range(len(job.loads)))
        job.gate.given_up = True

    def _keys(self, job: LoadJob, j: int) -> list[str]:
        """Every object of load ``j``'s chunk on this rank (one per shard it holds)."""
        ld = job.loads[j]
        return [f.prefix + ld.chunk_hash for f in self.ctx.groups.values() if f.source == ld.group]
