"""The worker's loads: a step's hits from the pool into vLLM's KV cache, layer by layer.

``lease`` the step's (layer, chunk) objects (the first layer's alone, so its copy starts
while the pool answers for the rest), check each layer's headers at once, and move the
pages into the cache. On accelerators every layer's copy is queued on a side stream
from ``start``, before the forward, and ``wait`` makes the compute stream wait on that
layer's event: the host hands nothing over while the forward runs (a handing-over
thread would take the GIL from it). On CPU a background thread copies layer by layer,
and ``wait`` waits for its layer. Missing or corrupt objects mark their chunk failed;
``errors`` reports their blocks and vLLM recomputes them. No failure in a load ever
propagates into the forward.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from ascend_store.backends import BackendUnavailable, Status
from ascend_store.device_path import LayerObjects, QueuedLoad
from ascend_store.metadata import ChunkLoad
from ascend_store.transfer import FLAG_WSUM, HEADER_RECORD, CorruptObject, decode_object, header_faults
from ascend_store.worker_context import WorkerContext

log = logging.getLogger("ascend_store")


class LoadJob:
    def __init__(self, loads: list[ChunkLoad], layers: list[str]):
        self.loads = loads
        self.unplaced = {j for j, ld in enumerate(loads) if 0 in ld.block_ids}  # has vLLM's null block
        self.events = {name: threading.Event() for name in layers}  # layer landed or queued
        self.device_events: dict[str, object] = {}  # layer -> its copy's event (accelerators)
        self.queued: list[tuple[QueuedLoad, list[tuple[int, str, int]]]] = []  # copy, (j, key, size)
        self.plan: list[tuple[str, int, str]] = []  # (layer, load index, key)
        self.leased: list[str] = []
        self.failed: set[int] = set()  # indexes into loads
        self.corrupt: set[int] = set()  # chunks whose objects are removed, so a recompute republishes them
        self.cancelled = False
        self.future: Future | None = None


class Loader:
    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx
        self.job: LoadJob | None = None  # this step's
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ascend-store-load")
        self._failed_chunks: set[str] = set()

    def start(self, loads: list[ChunkLoad]) -> LoadJob:
        job = self.job = LoadJob(loads, self.ctx.order)
        if self.ctx.device_path is not None:
            self._queue_device_load(job)
        else:
            job.future = self._thread.submit(self._run_load, job)
        return job

    def wait(self, layer_name: str) -> None:
        """Return once ``layer_name`` may be read: its copy landed (CPU) or the compute
        stream waits on it (accelerators)."""
        job = self.job
        if job is None:
            return
        ev = job.events.get(layer_name)
        if ev is not None and not ev.wait(self.ctx.cfg.load_timeout_s):
            self._abandon(job, f"layer {layer_name} not loaded within {self.ctx.cfg.load_timeout_s}s")
        if self.ctx.device_path is not None:  # the compute stream waits; the host does not
            self.ctx.device_path.dev.wait(job.device_events.get(layer_name))

    def finish(self, job: LoadJob) -> None:
        """Every layer of ``job`` landed, or is awaited by the compute stream."""
        if job.future is not None and wait([job.future], timeout=self.ctx.cfg.load_timeout_s).not_done:
            self._abandon(job, "load job did not finish")
        if self.ctx.device_path is not None:
            for event in job.device_events.values():
                self.ctx.device_path.dev.wait(event)

    def errors(self) -> set[int]:
        """The step's blocks whose load failed (vLLM recomputes them)."""
        job, self.job = self.job, None
        if job is None:
            return set()
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

    # -- leasing and checking -------------------------------------------------------
    def _lease(self, job: LoadJob):
        """Plan and lease the job's objects; returns the arena, each layer's (load index,
        key), the slots, and ``rest()``, which leases what is past the first layer."""
        ctx = self.ctx
        ctx.arena()  # map the arena first so slot bounds are checked against it
        job.plan = ctx.plan(job.loads)
        # Requests sharing a prefix name the same objects: lease each key once.
        layer_of = {k: name for name, _, k in job.plan}
        unique = list(layer_of)
        sizes = {name: ctx.object_bytes(name) for name in ctx.order}
        slots: dict = {}

        def lease(keys: list[str]) -> None:
            got = ctx.backend.lease(keys, [sizes[layer_of[k]] for k in keys])
            slots.update(zip(keys, got))
            job.leased.extend(k for k, s in zip(keys, got) if s.status is Status.OK)

        by_layer: dict[str, list[tuple[int, str]]] = {}
        for name, j, key in job.plan:
            by_layer.setdefault(name, []).append((j, key))
        head = len(by_layer[job.plan[0][0]]) if job.plan else 0
        lease(unique[:head])
        arena = ctx.arena()  # again: a pool restart seen by the lease remaps it

        def rest() -> None:
            if len(slots) < len(unique):
                lease(unique[head:])
                if ctx.arena() is not arena:
                    raise BackendUnavailable("the pool restarted during a load")

        return arena, by_layer, slots, rest

    def _admit(self, job: LoadJob, arena: torch.Tensor, names: list[str], by_layer: dict,
               slots: dict) -> dict[str, tuple[list[tuple[int, str, object]], np.ndarray]]:
        """The gate loaded objects pass on either path: skip chunks that already failed,
        count missing objects, refuse vLLM's null block, then check the headers (and
        payload sums the device copy will not compute) of all ``names``' objects in one
        pass per page layout. Returns per layer the admitted (load index, key, slot) and
        their headers (HEADER_RECORD)."""
        ctx = self.ctx
        groups: dict[tuple, list[tuple[str, int, str, object]]] = {}
        missing = 0
        for name in names:
            group = groups.setdefault((ctx.layouts[name].describe(), ctx.codecs[name].name,
                                       ctx.object_blocks(name)), [])
            for j, key in by_layer.get(name, ()):
                slot = slots[key]
                if j in job.failed:
                    continue
                if slot.status is not Status.OK:
                    missing += 1
                    job.failed.add(j)
                elif j in job.unplaced:  # vLLM's null block: nowhere to load to
                    self._rejected(job, j, CorruptObject(f"{key}: no block allocated for it"))
                else:
                    group.append((name, j, key, slot))
        ctx.counters["load_missing"] += missing
        out: dict[str, tuple[list, list[int], np.ndarray]] = {}  # layer -> entries, their rows, headers
        for todo in groups.values():
            if not todo:
                continue
            name = todo[0][0]  # any layer of the group: they share layout, codec and size
            faults, headers = header_faults(
                arena.numpy(), [t[3].offset for t in todo], [t[3].size for t in todo], [t[2] for t in todo],
                ctx.layouts[name], ctx.object_blocks(name), ctx.cfg.verify_checksum, ctx.codecs[name],
                wsum_later=ctx.device_path is not None)
            for i, ((layer, j, key, slot), fault) in enumerate(zip(todo, faults)):
                if fault is not None:
                    self._rejected(job, j, CorruptObject(fault))
                else:
                    entries, picked, _ = out.setdefault(layer, ([], [], headers))
                    entries.append((j, key, slot))
                    picked.append(i)
        result = {}
        for name in names:
            entries, picked, headers = out.get(name, ([], [], np.zeros(0, dtype=HEADER_RECORD)))
            result[name] = (entries, headers[picked])
            ctx.counters["loaded_objects"] += len(entries)
            ctx.counters["loaded_bytes"] += sum(e[2].size for e in entries)
        return result

    def _rejected(self, job: LoadJob, j: int, exc: CorruptObject) -> None:
        self.ctx.counters["load_corrupt"] += 1
        log.warning("KV pool object rejected, recomputing: %s", exc)
        job.failed.add(j)
        job.corrupt.add(j)

    # -- the two paths --------------------------------------------------------------
    def _run_load(self, job: LoadJob) -> None:
        """The host path (a background thread): layer by layer, check and decode."""
        ctx = self.ctx
        t0 = time.perf_counter()
        try:
            arena, by_layer, slots, rest = self._lease(job)
            rest()
            for name in ctx.order:
                if job.cancelled:
                    break
                entries, headers = self._admit(job, arena, [name], by_layer, slots)[name]
                for (j, key, slot), n in zip(entries, headers["payload"].tolist()):
                    try:
                        decode_object(arena[slot.offset:slot.offset + slot.size], n,
                                      ctx.layouts[name], job.loads[j].block_ids, job.loads[j].skip, key,
                                      ctx.object_blocks(name), ctx.codecs[name])
                    except CorruptObject as exc:
                        self._rejected(job, j, exc)
                job.events[name].set()
        except Exception as exc:  # the pool is an optimization: never fail the forward
            self._load_failed(job, exc)
        finally:
            for ev in job.events.values():
                ev.set()
            ctx.counters["load_seconds"] += time.perf_counter() - t0
            self._release(job)

    def _queue_device_load(self, job: LoadJob) -> None:
        """The accelerator path, before the forward: per layer, check the headers and
        queue one batched copy on the load stream. Checksums are compared at the end of
        the step (``_check_device_load``)."""
        ctx = self.ctx
        t0 = time.perf_counter()
        try:
            arena, by_layer, slots, rest = self._lease(job)
            first, others = ctx.order[:1], ctx.order[1:]
            for names in (first, others):
                if names is others:
                    rest()  # the first layer's copy is queued: lease the others meanwhile
                for name, (entries, headers) in self._admit(job, arena, names, by_layer, slots).items():
                    if not entries:
                        continue
                    loads = [job.loads[j] for j, _, _ in entries]
                    stored = np.where(headers["flags"] & FLAG_WSUM, headers["crc"].astype(np.int64), -1)
                    objs = LayerObjects(name, [e[2].offset for e in entries], [e[2].size for e in entries],
                                        [ld.block_ids for ld in loads], [ld.skip for ld in loads],
                                        [e[1] for e in entries], stored.tolist())
                    q = ctx.device_path.queue_load(arena, objs)
                    job.queued.append((q, [(j, key, slot.size) for j, key, slot in entries]))
                    job.device_events[name] = q.done
        except Exception as exc:
            self._load_failed(job, exc)
        finally:
            for ev in job.events.values():
                ev.set()
            ctx.counters["load_seconds"] += time.perf_counter() - t0

    def _check_device_load(self, job: LoadJob) -> None:
        """Wait for the queued copies and compare their checksums; then release the
        leases off the step's path (the copies no longer read the arena)."""
        for q, owners in job.queued:
            for i in self.ctx.device_path.check_load(q, self.ctx.cfg.verify_checksum):
                j, key, size = owners[i]
                self.ctx.counters["loaded_objects"] -= 1
                self.ctx.counters["loaded_bytes"] -= size
                self._rejected(job, j, CorruptObject(f"{key}: checksum mismatch"))
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
            if job.corrupt:  # every layer's object of the chunk: a hit needs them all
                self.ctx.backend.remove(sorted({k for _, j, k in job.plan if j in job.corrupt}))
        except BackendUnavailable:
            pass  # the pool drops our leases when their TTL ends

    def _abandon(self, job: LoadJob, why: str) -> None:
        log.warning("KV pool load abandoned (%s); recomputing", why)
        self.ctx.counters["load_timeouts"] += 1
        job.cancelled = True
        job.failed.update(range(len(job.loads)))
