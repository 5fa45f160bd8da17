"""The worker's saves: a step's new full chunks from vLLM's KV cache into the pool.

One ``reserve`` of the step's chunk objects (one per chunk and KV cache group, every
layer inside: worker_context.py), a copy task per layer queued by ``save_layer`` right
after the layer wrote its KV (from an event recorded on the compute stream, on
accelerators), and one ``commit`` once the copies are done, so objects become visible even
if the engine goes idle. The save thread seals the objects (headers, sums); the commit and
abort calls go to a publish thread of their own, so that a slow commit never delays the
next step's reserve. Only objects whose every layer part was written are committed; the
rest are aborted. Variable-size codecs (zstd) encode each
layer as it comes and reserve at the end, when the sizes are known.

``defer_drain``: the wait for the last layers' copies moves from the end of the step to
the start of the next one (vLLM's ``handle_preemptions``, called first in
``execute_model``, before it zeroes, loads into or computes into any block). So a block
freed after this step cannot be rewritten while its save still reads it, and the tail of
the save overlaps the scheduler's work for the next step. That wait holds the host only
until every copy is queued: on an accelerator the compute stream then waits for the save
stream on the device (the next step's loads start after the compute stream's queued work,
so they wait too), and the commit goes on behind it (headers on the save thread, the
pool's ``commit`` on the publish thread). A step whose reply must not overtake its
objects (``publish``: a P/D producer's last prompt step) waits for the commit too.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import torch

from ascend_store.backends import BackendUnavailable, Status
from ascend_store.backends.base import STATUSES
from ascend_store.common.metadata import ChunkSave
from ascend_store.common.transfer import FLAG_WSUM, HEADER_BYTES, seal, seal_headers, write_object
from ascend_store.device.device_work import LayerObjects
from ascend_store.device.segments import CopyPlanner, StepPages
from ascend_store.worker.worker_context import GroupStep, WorkerContext

log = logging.getLogger("ascend_store")


@dataclass
class Reserved:
    """A group's objects of the step: their slots (-1: not reserved), the layer parts
    written so far per object, and the entries' pages for the batched copies. For
    fixed-size codecs every per-layer quantity of the reserved objects is one [layer,
    reserved object] array, built once a step: a layer's save only takes its row."""

    step: GroupStep
    offsets: np.ndarray  # per object
    written: np.ndarray  # per object: layer parts written
    planner: CopyPlanner | None = None
    encoded: dict[int, list[bytes]] = field(default_factory=dict)  # variable codecs: object -> parts
    saves: list = field(default_factory=list)  # per object: its ChunkSave
    ok: np.ndarray | None = None  # indexes of the reserved objects
    parts: np.ndarray | None = None  # [layer, reserved object] part offsets
    sizes: np.ndarray | None = None  # [layer, reserved object] part sizes (header included)
    fps: np.ndarray | None = None  # [layer, reserved object] header fingerprints
    raw_blocks: int = 0  # blocks of the step's objects (a layer saves this many pages)


class SaveJob:
    def __init__(self, saves: list[ChunkSave]):
        self.saves = saves
        self.groups: dict[int, Reserved] = {}
        self.futures: list[Future] = []  # the reserve and the layers' copies: what reads the blocks
        self.pending: deque = deque()  # (layer, event) saves the save thread has not taken yet
        self.draining = False  # a drain of ``pending`` is queued and has not started
        self.commit: Future | None = None  # set once its objects are published (or given up)
        self.device_saves: list = []  # (queued copy, Reserved, layer index) to seal at commit
        self.cancelled = False


class Saver:
    def __init__(self, ctx: WorkerContext, defer_drain: bool):
        self.ctx = ctx
        self.defer_drain = defer_drain
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ascend-store-save")
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="ascend-store-publish")
        self._job: SaveJob | None = None  # this step's
        self._draining: SaveJob | None = None  # a finished step's, when deferred
        self._stuck: Future | None = None  # the reserve of a job dropped for want of an answer
        self._in_call_since: float | None = None  # when the save thread's pool call began

    def _pool(self, op: str, *args):
        """A pool call on the save thread (the one ``_finish`` may wait for), timed."""
        self._in_call_since = time.monotonic()
        try:
            return getattr(self.ctx.backend, op)(*args)
        finally:
            self._in_call_since = None

    def save_layer(self, layer_name: str, saves: list[ChunkSave] | None) -> None:
        """Queue the save of ``layer_name``'s part of this step's chunks (it just wrote them)."""
        job = self._step_job(saves)
        if job is not None and layer_name in self.ctx.group_of:
            self._queue_layers(job, [(layer_name, self._now())])

    def end_step(self, saves: list[ChunkSave] | None, whole: bool, publish: bool = False) -> None:
        """The step's forward is done: queue the commit (after every layer's copy, all
        queued here when ``whole``); wait for the copies now or at the next step, and with
        ``publish`` for the commit too, now."""
        job, self._job = self._step_job(saves), None
        if job is None:
            if saves and self._unanswered():
                self.ctx.counters["save_skipped_unanswered"] += 1
            return
        if whole:
            after = self._now()
            self._queue_layers(job, [(n, after) for n in self.ctx.order])
        job.commit = Future()
        self._thread.submit(self._run_commit, job)
        if publish:
            self._finish(job, committed=True)
        elif self.defer_drain:
            self._draining = job
        else:
            self._finish(job)

    def drain(self, committed: bool = False) -> None:
        """Wait for a finished step's copies (``committed``: its commit too), deferred to now."""
        job, self._draining = self._draining, None
        if job is not None:
            self.ctx.counters["deferred_drains"] += 1
            self._finish(job, committed)

    def shutdown(self) -> None:
        self.drain(committed=True)
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._publisher.shutdown(wait=True)

    def _now(self):
        """An event at this point of the compute stream, for the batched path's copy of a
        save to start from (None without that path)."""
        dp = self.ctx.device_path
        return dp.dev.record() if dp is not None else None

    def _unanswered(self) -> bool:
        """Whether a dropped job's reserve is still waiting for the pool (then the steps
        save nothing: their reserves would queue behind it, and each step would wait)."""
        return self._stuck is not None and not self._stuck.done()

    def _step_job(self, saves: list[ChunkSave] | None) -> SaveJob | None:
        if self._job is None and saves and not self._unanswered():
            self._job = SaveJob(saves)
            self._job.futures.append(self._thread.submit(self._run_reserve, self._job))
        return self._job

    def _queue_layers(self, job: SaveJob, layers: list[tuple[str, object]]) -> None:
        """Hand layers to the save thread: one task takes every layer queued by the time it
        runs (a task per layer cost a future and a thread handoff each, ~10 us of the
        forward's thread and more of the save thread's, 28 times a step)."""
        job.pending.extend(layers)
        if not job.draining:
            job.draining = True
            job.futures.append(self._thread.submit(self._drain_layers, job))

    def _finish(self, job: SaveJob, committed: bool = False) -> None:
        """Return once the job's copies no longer read its blocks (``committed``: once its
        objects are published). On an accelerator the copies need only be queued: the
        compute stream waits for them on the device, the host does not. A job whose
        reserve has not returned while the save thread has been waiting for the pool longer
        than ``lookup_timeout_s`` (in that reserve or an earlier step's) is dropped:
        its copies have not started (they follow the reserve on the save thread) and will
        not, and its commit gives the reservations back. A save thread busy copying is
        waited for, as below."""
        reserve = job.futures[0]
        while not committed and not reserve.done():
            since = self._in_call_since
            if since is not None and time.monotonic() - since > self.ctx.cfg.lookup_timeout_s:
                job.cancelled = True
                self._stuck = reserve
                self.ctx.counters["save_skipped_unanswered"] += 1
                return
            wait([reserve], timeout=self.ctx.cfg.lookup_timeout_s / 4)
        futures = job.futures + [job.commit] if committed else job.futures
        if wait(futures, timeout=self.ctx.cfg.load_timeout_s).not_done:
            # Stop the copies before vLLM reuses the blocks; unpublished objects expire.
            job.cancelled = True
            log.warning("KV pool save did not finish in time; its objects expire unpublished")
            self.ctx.counters["save_errors"] += 1
            return
        dp = self.ctx.device_path
        if dp is not None and not committed:
            dp.dev.wait(dp.dev.record(dp.save_stream))

    # -- on the save thread ---------------------------------------------------------
    def _run_reserve(self, job: SaveJob) -> None:
        ctx = self.ctx
        try:
            ctx.arena()  # map the arena first so slot bounds are checked against it
            # Requests sharing a prefix save the same chunk in one step: once.
            steps = ctx.plan(job.saves, dedupe=True)
            for st in steps:
                job.groups[st.fmt.group] = Reserved(
                    st, np.full(len(st.keys), -1, dtype=np.int64), np.zeros(len(st.keys), dtype=np.int64),
                    saves=[job.saves[j] for j in st.entries.tolist()], raw_blocks=int(st.blocks.sum()))
            fixed = [job.groups[st.fmt.group] for st in steps if st.fmt.fixed]
            if fixed:  # one reserve for the whole step; variable sizes reserve at commit
                self._reserve(fixed, [r.step.fmt.size(r.step.blocks) for r in fixed])
            for r in fixed:  # where every layer's part of every reserved object goes
                fmt, r.ok = r.step.fmt, np.flatnonzero(r.offsets >= 0)
                blocks = r.step.blocks[r.ok]
                r.parts, r.sizes = fmt.parts(r.offsets[r.ok], blocks), fmt.part_sizes(blocks)
                r.fps = fmt.fingerprints([r.step.keys[k] for k in r.ok.tolist()])
        except Exception as exc:
            if not isinstance(exc, BackendUnavailable):
                log.exception("KV pool reserve failed; not saving this step")
            ctx.counters["save_errors"] += 1

    def _reserve(self, groups: list[Reserved], sizes: list[np.ndarray]) -> None:
        keys = [k for r in groups for k in r.step.keys]
        slots = self._pool("reserve_slots", keys, np.concatenate(sizes))
        ok = slots.status == Status.OK
        for status, count in zip(*np.unique(slots.status[~ok], return_counts=True)):
            self.ctx.counters["save_skipped_" + STATUSES[status].name.lower()] += int(count)
        at = 0
        for r in groups:
            n = len(r.step.keys)
            r.offsets[:n] = np.where(ok[at:at + n], slots.offset[at:at + n], r.offsets[:n])
            at += n

    def _drain_layers(self, job: SaveJob) -> None:
        job.draining = False  # a layer queued from now on may need a task of its own
        while job.pending:
            self._run_save_layer(job, *job.pending.popleft())

    def _run_save_layer(self, job: SaveJob, name: str, after=None) -> None:
        ctx = self.ctx
        t0 = time.perf_counter()
        g, i = ctx.group_of[name]
        r = job.groups.get(g)
        if r is not None and not job.cancelled:
            layout, codec = ctx.layouts[name], ctx.codecs[name]
            saves = r.saves
            if not codec.fixed_size:
                for k, sv in enumerate(saves):  # encoded now (the blocks may be reused later)
                    r.encoded.setdefault(k, []).append(codec.encode_bytes(layout, sv.block_ids))
            elif ctx.device_path is not None:
                self._save_on_device(job, r, saves, name, i, after)
            else:
                self._save_on_host(r, saves, name, i)
            ctx.counters["saved_raw_bytes"] += r.raw_blocks * layout.page_bytes
        ctx.counters["save_seconds"] += time.perf_counter() - t0

    def _save_on_host(self, r: Reserved, saves: list[ChunkSave], name: str, i: int) -> None:
        ctx = self.ctx
        arena = ctx.arena()
        st = r.step
        for k, off, size in zip(r.ok.tolist(), r.parts[i].tolist(), r.sizes[i].tolist()):  # reserved ones
            sv = saves[k]
            try:
                write_object(arena[off:off + size], ctx.layouts[name], sv.block_ids, st.keys[k],
                             ctx.cfg.verify_checksum, ctx.codecs[name], salt=int(st.fmt.salts[i]))
                r.written[k] += 1
            except Exception:
                log.exception("KV pool save of %s layer %s failed", st.keys[k], name)

    def _save_on_device(self, job: SaveJob, r: Reserved, saves: list[ChunkSave], name: str, i: int,
                        after) -> None:
        ok = r.ok
        if ok is None or not len(ok):
            return
        if r.planner is None:  # one copy plan for every layer of the step
            r.planner = CopyPlanner(StepPages.of([saves[k].block_ids for k in ok.tolist()], [0] * len(ok)))
        objs = LayerObjects(name, r.parts[i], r.sizes[i], [], [], [], planner=r.planner, fps=r.fps[i])
        job.device_saves.append((self.ctx.device_path.save_layer(self.ctx.arena(), objs, after), r))

    def _seal_device_saves(self, job: SaveJob) -> None:
        """Headers go in once the layers' copies are done, with the sums they computed:
        one numpy pass for every layer part of the step."""
        ctx = self.ctx
        flags = FLAG_WSUM if ctx.cfg.verify_checksum else 0
        sums = ctx.device_path.finish_saves([q for q, _ in job.device_saves])
        by_codec: dict[str, list] = {}
        for (q, r), s in zip(job.device_saves, sums):
            by_codec.setdefault(ctx.codecs[q.objs.name].name, []).append((q.objs, s))
            r.written[r.ok] += 1
        host = ctx.arena().numpy()
        for parts in by_codec.values():
            o0 = parts[0][0]
            seal_headers(host, np.concatenate([o.offsets for o, _ in parts]),
                         np.concatenate([np.asarray(o.sizes) for o, _ in parts]) - HEADER_BYTES,
                         np.concatenate([o.fps for o, _ in parts]), ctx.layouts[o0.name], ctx.codecs[o0.name],
                         flags, np.concatenate([np.asarray(s, dtype=np.int64) for _, s in parts]))

    def _write_encoded(self, r: Reserved) -> None:
        """Variable-size codecs: reserve each object at its packed size, write its parts."""
        ctx = self.ctx
        st = r.step
        done = [k for k, parts in r.encoded.items() if len(parts) == len(st.fmt.layers)]
        if not done:
            return
        padded = {k: [-(-(HEADER_BYTES + len(p)) // 8) * 8 for p in r.encoded[k]] for k in done}
        sizes = np.zeros(len(st.keys), dtype=np.int64)
        for k in done:
            sizes[k] = sum(padded[k])
        sub = Reserved(GroupStep(st.fmt, st.entries, st.obj, [st.keys[k] for k in done], st.blocks[done]),
                       np.full(len(done), -1, dtype=np.int64), np.zeros(len(done), dtype=np.int64))
        self._reserve([sub], [sizes[done]])
        arena = ctx.arena()
        for pos, k in enumerate(done):
            r.offsets[k] = at = int(sub.offsets[pos])
            if at < 0:
                continue
            for i, (name, payload) in enumerate(zip(st.fmt.layers, r.encoded[k])):
                obj = arena[at:at + HEADER_BYTES + len(payload)]
                obj[HEADER_BYTES:].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
                seal(obj, len(payload), ctx.layouts[name], st.keys[k], ctx.codecs[name],
                     ctx.cfg.verify_checksum,
                     salt=int(st.fmt.salts[i]))
                at += padded[k][i]
            r.written[k] = len(st.fmt.layers)

    def _run_commit(self, job: SaveJob) -> None:
        """Seal what the copies wrote; the pool's commit (and aborts) go to the publish thread."""
        ctx = self.ctx
        done, given_back, sizes = [], [], [np.zeros(0, dtype=np.int64)]
        try:
            if job.cancelled:  # dropped: give back what the reserve got (nothing else would)
                given_back = [r.step.keys[k] for r in job.groups.values()
                              for k in np.flatnonzero(r.offsets >= 0).tolist()]
            else:
                if job.device_saves:
                    self._seal_device_saves(job)
                for r in job.groups.values():
                    if not r.step.fmt.fixed:
                        self._write_encoded(r)
                for r in job.groups.values():
                    held = np.flatnonzero(r.offsets >= 0)
                    whole = r.written[held] == len(r.step.fmt.layers)  # commit only objects fully written
                    done += [r.step.keys[k] for k in held[whole].tolist()]
                    given_back += [r.step.keys[k] for k in held[~whole].tolist()]
                    sizes.append(r.step.fmt.size(r.step.blocks)[held[whole]])
                ctx.counters["save_incomplete"] += len(given_back)
        except Exception as exc:
            if not isinstance(exc, BackendUnavailable):
                log.exception("KV pool save failed; its objects expire unpublished")
            ctx.counters["save_errors"] += 1
            done, given_back = [], []
        self._publisher.submit(self._publish, job, done, given_back, np.concatenate(sizes))

    def _publish(self, job: SaveJob, done: list[str], given_back: list[str], sizes: np.ndarray) -> None:
        ctx = self.ctx
        try:
            if given_back:
                ctx.backend.abort(given_back)
            if done:
                ok = np.fromiter((st is Status.OK for st in ctx.backend.commit(done)), dtype=bool)
                ctx.counters["saved_objects"] += int(ok.sum())
                ctx.counters["saved_bytes"] += int(sizes[:len(ok)][ok].sum())
        except BackendUnavailable:
            # An abort not delivered: the pool reclaims a reservation at its deadline.
            if done:
                ctx.counters["save_errors"] += 1
        finally:
            job.commit.set_result(None)
