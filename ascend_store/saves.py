"""The worker's saves: a step's new full chunks from vLLM's KV cache into the pool.

One ``reserve`` for every (layer, chunk) object of the step, a copy task per layer
queued by ``save_layer`` right after the layer wrote its KV (from an event recorded on
the compute stream, on accelerators), and one ``commit`` once the copies are done, on
the save thread, so objects become visible even if the engine goes idle.

``defer_drain``: the wait for the last layers' copies moves from the end of the step to
the start of the next one (vLLM's ``handle_preemptions``, called first in
``execute_model``, before it zeroes, loads into or computes into any block). So a block
freed after this step cannot be rewritten while its save still reads it, and the tail of
the save overlaps the scheduler's work for the next step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from ascend_store.backends import BackendUnavailable, Status
from ascend_store.device_path import LayerObjects
from ascend_store.metadata import ChunkSave
from ascend_store.transfer import FLAG_WSUM, HEADER_BYTES, seal, seal_headers, write_object
from ascend_store.worker_context import WorkerContext

log = logging.getLogger("ascend_store")


class SaveJob:
    def __init__(self, saves: list[ChunkSave]):
        self.saves = saves
        self.plan: list[tuple[str, int, str]] = []  # (layer, save index, key), deduplicated
        self.slots: dict[tuple[str, int], tuple[str, int, int]] = {}  # (layer, j) -> key, off, size
        self.failed: set[str] = set()
        self.futures: list[Future] = []
        self.device_saves: list = []  # queued copies to seal at commit (accelerators)
        self.cancelled = False


class Saver:
    def __init__(self, ctx: WorkerContext, defer_drain: bool):
        self.ctx = ctx
        self.defer_drain = defer_drain
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ascend-store-save")
        self._job: SaveJob | None = None  # this step's
        self._draining: SaveJob | None = None  # a finished step's, when deferred

    def save_layer(self, layer_name: str, saves: list[ChunkSave] | None) -> None:
        """Queue the save of ``layer_name``'s part of this step's chunks (it just wrote them)."""
        job = self._step_job(saves)
        if job is not None and layer_name in self.ctx.layouts:
            job.futures.append(self._thread.submit(self._run_save_layer, job, layer_name, self._now()))

    def end_step(self, saves: list[ChunkSave] | None, whole: bool) -> None:
        """The step's forward is done: queue the commit (after every layer's copy, all
        queued here when ``whole``), and wait for it now or at the next step."""
        job, self._job = self._step_job(saves), None
        if job is None:
            return
        if whole:
            after = self._now()
            job.futures += [self._thread.submit(self._run_save_layer, job, n, after) for n in self.ctx.order]
        job.futures.append(self._thread.submit(self._run_commit, job))
        if self.defer_drain:
            self._draining = job
        else:
            self._finish(job)

    def drain(self) -> None:
        """Wait for a finished step's save, deferred to now."""
        job, self._draining = self._draining, None
        if job is not None:
            self.ctx.counters["deferred_drains"] += 1
            self._finish(job)

    def shutdown(self) -> None:
        self.drain()
        self._thread.shutdown(wait=True, cancel_futures=True)

    def _now(self):
        """An event at this point of the compute stream, for the batched path's copy of a
        save to start from (None without that path)."""
        dp = self.ctx.device_path
        return dp.dev.record() if dp is not None else None

    def _step_job(self, saves: list[ChunkSave] | None) -> SaveJob | None:
        if self._job is None and saves:
            self._job = SaveJob(saves)
            self._job.futures.append(self._thread.submit(self._run_reserve, self._job))
        return self._job

    def _finish(self, job: SaveJob) -> None:
        if wait(job.futures, timeout=self.ctx.cfg.load_timeout_s).not_done:
            # Stop the copies before vLLM reuses the blocks; unpublished objects expire.
            job.cancelled = True
            log.warning("KV pool save did not finish in time; its objects expire unpublished")
            self.ctx.counters["save_errors"] += 1

    # -- on the save thread ---------------------------------------------------------
    def _run_reserve(self, job: SaveJob) -> None:
        ctx = self.ctx
        try:
            ctx.arena()  # map the arena first so slot bounds are checked against it
            # Requests sharing a prefix save the same chunk in one step: reserve it once.
            first = {}
            for entry in ctx.plan(job.saves):
                first.setdefault(entry[2], entry)
            job.plan = list(first.values())
            fixed = [e for e in job.plan if ctx.codecs[e[0]].fixed_size]
            if fixed:  # one reserve for the whole step; variable sizes reserve per layer
                self._reserve(job, fixed, [ctx.object_bytes(n) for n, _, _ in fixed])
        except Exception as exc:
            if not isinstance(exc, BackendUnavailable):
                log.exception("KV pool reserve failed; not saving this step")
            ctx.counters["save_errors"] += 1

    def _reserve(self, job: SaveJob, plan: list, sizes: list[int]) -> None:
        for (name, j, key), slot in zip(plan, self.ctx.backend.reserve([k for _, _, k in plan], sizes)):
            if slot.status is Status.OK:
                job.slots[(name, j)] = (key, slot.offset, slot.size)
            else:
                self.ctx.counters["save_skipped_" + slot.status.name.lower()] += 1

    def _run_save_layer(self, job: SaveJob, name: str, after=None) -> None:
        ctx = self.ctx
        t0 = time.perf_counter()
        arena = ctx.arena()
        layout = ctx.layouts[name]
        codec = ctx.codecs[name]
        if ctx.device_path is not None and codec.fixed_size:
            self._save_on_device(job, arena, name, after)
            ctx.counters["save_seconds"] += time.perf_counter() - t0
            return
        encoded = {}
        if not codec.fixed_size and not job.cancelled:
            # Sizes are known only after encoding: reserve this layer's objects now.
            mine = [e for e in job.plan if e[0] == name]
            encoded = {e[2]: codec.encode_bytes(layout, job.saves[e[1]].block_ids) for e in mine}
            try:
                self._reserve(job, mine, [HEADER_BYTES + len(encoded[k]) for _, _, k in mine])
            except BackendUnavailable:
                ctx.counters["save_errors"] += 1
        for j, sv in enumerate(job.saves):
            target = job.slots.get((name, j))
            if target is None or job.cancelled:
                continue
            key, off, size = target
            obj = arena[off:off + size]
            try:
                if key in encoded:
                    obj[HEADER_BYTES:].copy_(torch.frombuffer(bytearray(encoded[key]), dtype=torch.uint8))
                    seal(obj, size - HEADER_BYTES, layout, key, codec, ctx.cfg.verify_checksum)
                else:
                    write_object(obj, layout, sv.block_ids, key, ctx.cfg.verify_checksum, codec)
                ctx.counters["saved_raw_bytes"] += len(sv.block_ids) * layout.page_bytes
            except Exception:
                log.exception("KV pool save of %s failed", key)
                job.failed.add(key)
        ctx.counters["save_seconds"] += time.perf_counter() - t0

    def _save_on_device(self, job: SaveJob, arena: torch.Tensor, name: str, after) -> None:
        if job.cancelled:
            return
        mine = [(job.slots[(name, j)], sv.block_ids) for j, sv in enumerate(job.saves)
                if (name, j) in job.slots]
        if not mine:
            return
        objs = LayerObjects(name, [t[1] for t, _ in mine], [t[2] for t, _ in mine], [b for _, b in mine],
                            [0] * len(mine), [t[0] for t, _ in mine])
        page_bytes = self.ctx.layouts[name].page_bytes
        self.ctx.counters["saved_raw_bytes"] += sum(len(b) for _, b in mine) * page_bytes
        job.device_saves.append(self.ctx.device_path.save_layer(arena, objs, after))

    def _seal_device_saves(self, job: SaveJob) -> None:
        """Headers go in once a layer's copy is done, with the sums it computed."""
        ctx = self.ctx
        host = ctx.arena().numpy()
        flags = FLAG_WSUM if ctx.cfg.verify_checksum else 0
        for q in job.device_saves:
            sums = ctx.device_path.finish_save(q)
            o = q.objs
            seal_headers(host, o.offsets, [size - HEADER_BYTES for size in o.sizes], o.keys,
                         ctx.layouts[o.name], ctx.codecs[o.name], flags, sums)

    def _run_commit(self, job: SaveJob) -> None:
        if job.cancelled:
            return
        sizes = {key: size for key, _, size in job.slots.values()}
        done = [k for k in sizes if k not in job.failed]
        try:
            if job.device_saves:
                self._seal_device_saves(job)
            self.ctx.backend.abort(sorted(job.failed))
            for key, status in zip(done, self.ctx.backend.commit(done)):
                if status is Status.OK:
                    self.ctx.counters["saved_objects"] += 1
                    self.ctx.counters["saved_bytes"] += sizes[key]
        except BackendUnavailable:
            self.ctx.counters["save_errors"] += 1
