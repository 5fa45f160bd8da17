"""Worker half: registers vLLM's KV caches and moves their blocks to and from the pool.

One load job and one save job per step:
- load: ``lease`` the step's (layer, chunk) objects (the first layer's alone, so its
  copy starts while the pool answers for the rest), check each layer's headers at once,
  and move the pages into the cache. On accelerators every layer's copy is queued on a
  side stream from ``start_load_kv``, before the forward, and ``wait_for_layer_load``
  makes the compute stream wait on that layer's event: the host hands nothing over
  while the forward runs (a handing-over thread would take the GIL from it). On CPU a
  background thread copies layer by layer, and ``wait_for_layer_load`` waits for its
  layer. Missing or corrupt objects mark their chunk failed; the blocks are reported
  through ``get_block_ids_with_load_errors`` and vLLM recomputes.
- save: one ``reserve`` for every (layer, chunk) object, a copy task per layer queued by
  ``save_kv_layer`` right after the layer wrote its KV, and one ``commit`` in
  ``wait_for_save``.
With ``use_layerwise: false`` the same jobs run whole: the load before the forward, the
save after it. No failure in a transfer ever propagates into the forward.

``defer_save_drain``: the wait for the last layers' copies and the commit move from the
end of the step to ``handle_preemptions`` of the next one, which vLLM calls first in
``execute_model``, before it zeroes, loads into or computes into any block. So a block
freed after this step cannot be rewritten while its save still reads it, and the tail
of the save overlaps the scheduler's work for the next step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from ascend_store import seams
from ascend_store.backends import BackendUnavailable, Status, create_backend
from ascend_store.codecs import get_codec
from ascend_store.config import StoreConfig
from ascend_store.device_path import DevicePath, LayerObjects, QueuedLoad
from ascend_store.hybrid import DeferredStateCopies, state_layout
from ascend_store.keys import KeySpace, identity_from_vllm
from ascend_store.layers import STATE, group_kinds, layer_ids
from ascend_store.metadata import ChunkLoad, ChunkSave, StepMetadata, WorkerReport
from ascend_store.stats import AscendStoreStats, IntervalCounters
from ascend_store.transfer import (
    FLAG_WSUM,
    HEADER_BYTES,
    HEADER_RECORD,
    CorruptObject,
    LayerLayout,
    decode_object,
    header_faults,
    object_bytes,
    seal,
    write_object,
)

log = logging.getLogger("ascend_store")


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError):  # no TP group (single process tools, tests)
        return 0


def _has_preemption_hook() -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if hasattr(KVConnectorBase_V1, "handle_preemptions"):
        return True
    log.warning("this vLLM has no handle_preemptions hook: saves drain inside each step")
    return False


class _LoadJob:
    def __init__(self, loads: list[ChunkLoad], layers: list[str]):
        self.loads = loads
        self.events = {name: threading.Event() for name in layers}  # layer landed or queued
        self.device_events: dict[str, object] = {}  # layer -> its copy's event (accelerators)
        self.queued: list[tuple[QueuedLoad, list[tuple[int, str, int]]]] = []  # copy, (j, key, size)
        self.plan: list[tuple[str, int, str]] = []  # (layer, load index, key)
        self.leased: list[str] = []
        self.failed: set[int] = set()  # indexes into loads
        self.corrupt: set[int] = set()  # chunks whose objects are removed, so a recompute republishes them
        self.cancelled = False
        self.future: Future | None = None


class _SaveJob:
    def __init__(self, saves: list[ChunkSave]):
        self.saves = saves
        self.plan: list[tuple[str, int, str]] = []  # (layer, save index, key), deduplicated
        self.slots: dict[tuple[str, int], tuple[str, int, int]] = {}  # (layer, j) -> key, off, size
        self.failed: set[str] = set()
        self.futures: list[Future] = []
        self.device_saves: list = []  # (queued copy, layer) to seal at commit (accelerators)
        self.cancelled = False


class PoolWorker:
    def __init__(self, vllm_config, kv_cache_config, cfg: StoreConfig, kv_role: str):
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.blocks_per_chunk = cfg.chunk_tokens(self.block_size) // self.block_size
        identity = identity_from_vllm(vllm_config, self.blocks_per_chunk * self.block_size, cfg.codec)
        self.codec = get_codec(cfg.codec)
        self.kv_specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self.keyspace = KeySpace(identity.namespace(), _tp_rank(), identity.tp_size)
        self.layer_ids = layer_ids(kv_cache_config)
        kinds = group_kinds(kv_cache_config)
        # Linear-attention layers: one state object per chunk boundary, always raw bytes.
        self.state_layers = {n for n, (g, _) in self.layer_ids.items() if kinds[g] == STATE}
        self.codecs = {n: get_codec("raw") if n in self.state_layers else self.codec for n in self.layer_ids}
        self.state_copies: DeferredStateCopies | None = None
        self.device_path: DevicePath | None = None
        self._step_loads = False
        self._waited: set[str] = set()
        self.load_step_layers: deque[int] = deque(maxlen=4096)  # layers that waited, per loading step
        self.num_blocks = kv_cache_config.num_blocks
        self.backend = create_backend(cfg, role="worker")
        self.layouts: dict[str, LayerLayout] = {}
        self.order: list[str] = []
        self._load_thread = ThreadPoolExecutor(1, thread_name_prefix="ascend-store-load")
        self._save_thread = ThreadPoolExecutor(1, thread_name_prefix="ascend-store-save")
        self._load: _LoadJob | None = None
        self._save: _SaveJob | None = None
        self._draining: _SaveJob | None = None  # a finished step's save, when deferred
        self.defer_drain = cfg.defer_save_drain and _has_preemption_hook()
        self._arena: tuple[str, torch.Tensor] | None = None
        self.counters = IntervalCounters()
        self._pool_stats_at = 0.0
        self.step_hooks: deque[tuple[int, int]] = deque(maxlen=4096)  # (waits, saves) per step
        self._waits = self._saves = 0
        self._failed_chunks: set[str] = set()
        self._rpcs_seen = 0

    # -- setup ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, tensor in kv_caches.items():
            if name not in self.layer_ids:
                raise ValueError(f"KV cache layer {name!r} is not in the KV cache config")
            if name in self.state_layers:
                views = (list(tensor) if isinstance(tensor, (list, tuple))
                         else seams.state_views(self.vllm_config, name))
                self.layouts[name] = state_layout(views, self.num_blocks)
                continue
            spec = self.kv_specs[self.layer_ids[name][0]]
            dims = tuple(getattr(spec, a, None) for a in ("num_kv_heads", "block_size", "head_size"))
            layout = LayerLayout.of(tensor, self.num_blocks, dims if None not in dims else None)
            try:
                self.codec.check(layout)
            except ValueError as exc:
                raise ValueError(f"ascend-store codec {self.codec.name!r} cannot store {name}: "
                                 f"{exc}") from None
            self.layouts[name] = layout
        self.order = [n for n in self.layer_ids if n in self.layouts]
        states = {n: self.layouts[n] for n in self.order if n in self.state_layers}
        first = self.layouts[next(n for n in self.order if n not in states)]
        log.info("ascend-store: %d layers (%d with recurrent state), page %s (%d bytes), %d blocks "
                 "per object, keys %s", len(self.order), len(states), first.describe(),
                 first.page_bytes, self.blocks_per_chunk, self.keyspace.namespace)
        if states:
            self._install_hybrid(states)
        device = self.layouts[self.order[0]].tensor.device
        batched = self.cfg.copy_path == "batched" or (self.cfg.copy_path == "auto" and device.type != "cpu")
        if batched and self.codec.name in DevicePath.CODECS:
            try:
                self.device_path = DevicePath(device, self.layouts, self.codecs)
            except ValueError as exc:  # an unaligned layout: per-block copies still work
                log.warning("ascend-store: batched device copies off (%s); copying block by block", exc)
        log.info("ascend-store: copy path %s on %s", "batched" if self.device_path else "per_block", device)
        if self.device_path is not None:
            try:  # pinning a large arena takes seconds: at startup, not in the first request
                self._arena_tensor()
            except BackendUnavailable:
                pass  # the pool is not up yet: pinned on first use

    def _install_hybrid(self, states: dict[str, LayerLayout]) -> None:
        """Make linear-attention layers drive the layer protocol and defer the runner's
        align-mode state copy (seams.py); refuse to start if this vLLM lacks a seam."""
        ops = seams.install_state_ops()
        if not ops:
            raise seams.SeamError("no linear-attention op of this vLLM could be hooked; the pool "
                                  "cannot serve this hybrid model (docs/hybrid.md)")
        self.state_copies = DeferredStateCopies(states)
        seams.install_state_copy(self._take_state_copies)
        log.info("ascend-store: hybrid model, layer protocol on ops %s", ", ".join(ops))

    def _take_state_copies(self, copy_bufs) -> bool:
        """The runner's align-mode copies of this step: ours to run after the loads when
        this step loads, vLLM's to run now otherwise."""
        if not (self._step_loads and self.cfg.defer_state_copy and copy_bufs.offset):
            return False
        self.state_copies.take(*seams.copy_plan(copy_bufs))
        self.counters["deferred_state_copies"] += copy_bufs.offset
        return True

    def _run_state_copies(self, layer: str | None = None) -> None:
        """Deferred copies of ``layer`` (of every layer when None), once its state landed."""
        if self.state_copies is None:
            return
        if layer is None:
            self.state_copies.run_all()
        else:
            self.state_copies.run(layer)

    def _key(self, layer: str, group: int, chunk_hash: str) -> str:
        return self.keyspace.key(group, self.layer_ids[layer][1], chunk_hash)

    def _arena_tensor(self) -> torch.Tensor:
        epoch, view = self.backend.buffer()
        if self._arena is None or self._arena[0] != epoch:
            arena = (self.device_path.arena(epoch, view) if self.device_path is not None
                     else torch.frombuffer(view, dtype=torch.uint8))  # pinned on accelerators
            self._arena = (epoch, arena)
        return self._arena[1]

    # -- loads ----------------------------------------------------------------
    def handle_preemptions(self, meta: StepMetadata | None = None) -> None:
        self._drain_saves()
        # vLLM queues the hybrid state copy after this call and before start_load_kv.
        self._step_loads = bool(meta is not None and getattr(meta, "loads", None))

    def start_load_kv(self, meta: StepMetadata) -> None:
        self._drain_saves()
        self.counters["steps"] += 1
        if not meta.loads:
            return
        job = self._load = _LoadJob(meta.loads, self.order)
        if self.device_path is not None:
            self._queue_device_load(job)
        else:
            job.future = self._load_thread.submit(self._run_load, job)
        if not self.cfg.use_layerwise:
            self._finish_load(job)
            self._run_state_copies()

    def _lease(self, job: _LoadJob):
        """Plan and lease the job's objects; returns the arena, each layer's (load index,
        key), the slots, and ``rest()``, which leases what is past the first layer."""
        self._arena_tensor()  # map the arena first so slot bounds are checked against it
        job.plan = [(name, j, self._key(name, ld.group, ld.chunk_hash))
                    for name in self.order for j, ld in enumerate(job.loads)
                    if ld.group == self.layer_ids[name][0]]
        # Requests sharing a prefix name the same objects: lease each key once.
        layer_of = {k: name for name, _, k in job.plan}
        unique = list(layer_of)
        sizes = {name: self._object_bytes(name) for name in self.order}
        slots: dict = {}

        def lease(keys: list[str]) -> None:
            got = self.backend.lease(keys, [sizes[layer_of[k]] for k in keys])
            slots.update(zip(keys, got))
            job.leased.extend(k for k, s in zip(keys, got) if s.status is Status.OK)

        by_layer: dict[str, list[tuple[int, str]]] = {}
        for name, j, key in job.plan:
            by_layer.setdefault(name, []).append((j, key))
        head = len(by_layer[job.plan[0][0]]) if job.plan else 0
        lease(unique[:head])
        arena = self._arena_tensor()  # again: a pool restart seen by the lease remaps it

        def rest() -> None:
            if len(slots) < len(unique):
                lease(unique[head:])
                if self._arena_tensor() is not arena:
                    raise BackendUnavailable("the pool restarted during a load")

        return arena, by_layer, slots, rest

    def _run_load(self, job: _LoadJob) -> None:
        """The host path (a background thread): layer by layer, check and decode."""
        t0 = time.perf_counter()
        try:
            arena, by_layer, slots, rest = self._lease(job)
            rest()
            for name in self.order:
                if job.cancelled:
                    break
                entries, headers = self._admit(job, arena, [name], by_layer, slots)[name]
                for (j, key, slot), n in zip(entries, headers["payload"].tolist()):
                    try:
                        decode_object(arena[slot.offset:slot.offset + slot.size], n,
                                      self.layouts[name], job.loads[j].block_ids, job.loads[j].skip, key,
                                      self._object_blocks(name), self.codecs[name])
                    except CorruptObject as exc:
                        self._rejected(job, j, exc)
                job.events[name].set()
        except Exception as exc:  # the pool is an optimization: never fail the forward
            self._load_failed(job, exc)
        finally:
            for ev in job.events.values():
                ev.set()
            self.counters["load_seconds"] += time.perf_counter() - t0
            self._release(job)

    def _queue_device_load(self, job: _LoadJob) -> None:
        """The accelerator path, before the forward: per layer, check the headers and
        queue one batched copy on the load stream. Checksums are compared at the end of
        the step (``_check_device_load``)."""
        t0 = time.perf_counter()
        try:
            arena, by_layer, slots, rest = self._lease(job)
            first, others = self.order[:1], self.order[1:]
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
                    q = self.device_path.queue_load(arena, objs)
                    job.queued.append((q, [(j, key, slot.size) for j, key, slot in entries]))
                    job.device_events[name] = q.done
        except Exception as exc:
            self._load_failed(job, exc)
        finally:
            for ev in job.events.values():
                ev.set()
            self.counters["load_seconds"] += time.perf_counter() - t0

    def _check_device_load(self, job: _LoadJob) -> None:
        """Wait for the queued copies and compare their checksums; then release the
        leases off the step's path (the copies no longer read the arena)."""
        for q, owners in job.queued:
            for i in self.device_path.check_load(q, self.cfg.verify_checksum):
                j, key, size = owners[i]
                self.counters["loaded_objects"] -= 1
                self.counters["loaded_bytes"] -= size
                self._rejected(job, j, CorruptObject(f"{key}: checksum mismatch"))
        self._load_thread.submit(self._release, job)

    def _load_failed(self, job: _LoadJob, exc: Exception) -> None:
        if not isinstance(exc, BackendUnavailable):
            log.exception("KV pool load failed; recomputing")
        self.counters["load_errors"] += 1
        job.failed.update(range(len(job.loads)))

    def _release(self, job: _LoadJob) -> None:
        try:
            if job.leased:
                self.backend.release(job.leased)
            if job.corrupt:  # every layer's object of the chunk: a hit needs them all
                self.backend.remove(sorted({k for _, j, k in job.plan if j in job.corrupt}))
        except BackendUnavailable:
            pass  # the pool drops our leases when their TTL ends

    def _admit(self, job: _LoadJob, arena: torch.Tensor, names: list[str], by_layer: dict,
               slots: dict) -> dict[str, tuple[list[tuple[int, str, object]], np.ndarray]]:
        """The gate loaded objects pass on either path: skip chunks that already failed,
        count missing objects, refuse vLLM's null block, then check the headers (and
        payload sums the device copy will not compute) of all ``names``' objects in one
        pass per page layout. Returns per layer the admitted (load index, key, slot) and
        their headers (HEADER_RECORD)."""
        groups: dict[tuple, list[tuple[str, int, str, object]]] = {}
        for name in names:
            group = groups.setdefault((self.layouts[name].describe(), self.codecs[name].name,
                                       self._object_blocks(name)), [])
            for j, key in by_layer.get(name, ()):
                slot = slots[key]
                if j in job.failed:
                    continue
                if slot.status is not Status.OK:
                    self.counters["load_missing"] += 1
                    job.failed.add(j)
                elif 0 in job.loads[j].block_ids:  # vLLM's null block: nowhere to load to
                    self._rejected(job, j, CorruptObject(f"{key}: no block allocated for it"))
                else:
                    group.append((name, j, key, slot))
        picked: dict[str, list[int]] = {name: [] for name in names}
        out = {}
        for todo in groups.values():
            if not todo:
                continue
            name = todo[0][0]  # any layer of the group: they share layout, codec and size
            faults, headers = header_faults(
                arena.numpy(), [t[3].offset for t in todo], [t[3].size for t in todo], [t[2] for t in todo],
                self.layouts[name], self._object_blocks(name), self.cfg.verify_checksum, self.codecs[name],
                wsum_later=self.device_path is not None)
            for i, ((layer, j, key, slot), fault) in enumerate(zip(todo, faults)):
                if fault is not None:
                    self._rejected(job, j, CorruptObject(fault))
                else:
                    picked[layer].append(i)
                    self.counters["loaded_objects"] += 1
                    self.counters["loaded_bytes"] += slot.size
            for layer in {t[0] for t in todo}:
                out[layer] = ([todo[i][1:] for i in picked[layer]], headers[picked[layer]])
        empty = np.zeros(0, dtype=HEADER_RECORD)
        return {name: out.get(name, ([], empty)) for name in names}

    def _rejected(self, job: _LoadJob, j: int, exc: CorruptObject) -> None:
        self.counters["load_corrupt"] += 1
        log.warning("KV pool object rejected, recomputing: %s", exc)
        job.failed.add(j)
        job.corrupt.add(j)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._waits += 1
        self._waited.add(layer_name)
        job = self._load
        if job is None or not self.cfg.use_layerwise:
            return
        ev = job.events.get(layer_name)
        if ev is not None and not ev.wait(self.cfg.load_timeout_s):
            self._abandon(job, f"layer {layer_name} not loaded within {self.cfg.load_timeout_s}s")
        if self.device_path is not None:  # the compute stream waits; the host does not
            self.device_path.dev.wait(job.device_events.get(layer_name))
        if layer_name in self.state_layers:
            self._run_state_copies(layer_name)

    def _abandon(self, job: _LoadJob, why: str) -> None:
        log.warning("KV pool load abandoned (%s); recomputing", why)
        self.counters["load_timeouts"] += 1
        job.cancelled = True
        job.failed.update(range(len(job.loads)))

    def _finish_load(self, job: _LoadJob) -> None:
        if job.future is not None and wait([job.future], timeout=self.cfg.load_timeout_s).not_done:
            self._abandon(job, "load job did not finish")
        if self.device_path is not None:
            for event in job.device_events.values():
                self.device_path.dev.wait(event)

    def get_block_ids_with_load_errors(self) -> set[int]:
        job, self._load = self._load, None
        if job is None:
            return set()
        self._finish_load(job)
        if self.device_path is not None:
            self._check_device_load(job)
        bad = {b for j in job.failed for b in job.loads[j].block_ids}
        self._failed_chunks.update(job.loads[j].chunk_hash for j in job.failed)
        self.counters["failed_blocks"] += len(bad)
        return bad

    def build_connector_worker_meta(self) -> WorkerReport | None:
        if not self._failed_chunks:
            return None
        report, self._failed_chunks = WorkerReport(sorted(self._failed_chunks)), set()
        return report

    # -- saves ----------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, meta: StepMetadata | None) -> None:
        self._saves += 1
        if not self.cfg.use_layerwise:
            return
        job = self._save_job(meta)
        if job is not None and layer_name in self.layouts:
            # On an accelerator the copy starts from this point of the compute stream.
            after = self.device_path.dev.record() if self.device_path is not None else None
            job.futures.append(self._save_thread.submit(self._run_save_layer, job, layer_name, after))

    def _save_job(self, meta: StepMetadata | None) -> _SaveJob | None:
        if self._save is None and meta is not None and meta.saves:
            self._save = _SaveJob(meta.saves)
            self._save.futures.append(self._save_thread.submit(self._run_reserve, self._save))
        return self._save

    def _run_reserve(self, job: _SaveJob) -> None:
        try:
            self._arena_tensor()  # map the arena first so slot bounds are checked against it
            plan = [(name, j, self._key(name, sv.group, sv.chunk_hash))
                    for name in self.order for j, sv in enumerate(job.saves)
                    if sv.group == self.layer_ids[name][0]]
            # Requests sharing a prefix save the same chunk in one step: reserve it once.
            first = {}
            for entry in plan:
                first.setdefault(entry[2], entry)
            job.plan = list(first.values())
            fixed = [e for e in job.plan if self.codecs[e[0]].fixed_size]
            if fixed:  # one reserve for the whole step; variable sizes reserve per layer
                self._reserve(job, fixed, [self._object_bytes(n) for n, _, _ in fixed])
        except Exception as exc:
            if not isinstance(exc, BackendUnavailable):
                log.exception("KV pool reserve failed; not saving this step")
            self.counters["save_errors"] += 1

    def _object_blocks(self, name: str) -> int:
        return 1 if name in self.state_layers else self.blocks_per_chunk

    def _object_bytes(self, name: str) -> int:
        return object_bytes(self.layouts[name], self._object_blocks(name), self.codecs[name])

    def _reserve(self, job: _SaveJob, plan: list, sizes: list[int]) -> None:
        for (name, j, key), slot in zip(plan, self.backend.reserve([k for _, _, k in plan], sizes)):
            if slot.status is Status.OK:
                job.slots[(name, j)] = (key, slot.offset, slot.size)
            else:
                self.counters["save_skipped_" + slot.status.name.lower()] += 1

    def _run_save_layer(self, job: _SaveJob, name: str, after=None) -> None:
        t0 = time.perf_counter()
        arena = self._arena_tensor()
        layout = self.layouts[name]
        codec = self.codecs[name]
        if self.device_path is not None and codec.fixed_size:
            self._save_on_device(job, arena, name, after)
            self.counters["save_seconds"] += time.perf_counter() - t0
            return
        encoded = {}
        if not codec.fixed_size and not job.cancelled:
            # Sizes are known only after encoding: reserve this layer's objects now.
            mine = [e for e in job.plan if e[0] == name]
            encoded = {e[2]: codec.encode_bytes(layout, job.saves[e[1]].block_ids) for e in mine}
            try:
                self._reserve(job, mine, [HEADER_BYTES + len(encoded[k]) for _, _, k in mine])
            except BackendUnavailable:
                self.counters["save_errors"] += 1
        for j, sv in enumerate(job.saves):
            target = job.slots.get((name, j))
            if target is None or job.cancelled:
                continue
            key, off, size = target
            obj = arena[off:off + size]
            try:
                if key in encoded:
                    obj[HEADER_BYTES:].copy_(torch.frombuffer(bytearray(encoded[key]), dtype=torch.uint8))
                    seal(obj, size - HEADER_BYTES, layout, key, codec, self.cfg.verify_checksum)
                else:
                    write_object(obj, layout, sv.block_ids, key, self.cfg.verify_checksum, codec)
                self.counters["saved_raw_bytes"] += len(sv.block_ids) * layout.page_bytes
            except Exception:
                log.exception("KV pool save of %s failed", key)
                job.failed.add(key)
        self.counters["save_seconds"] += time.perf_counter() - t0

    def _save_on_device(self, job: _SaveJob, arena: torch.Tensor, name: str, after) -> None:
        objs = LayerObjects(name, [], [], [], [], [])
        for j, sv in enumerate(job.saves):
            target = job.slots.get((name, j))
            if target is None or job.cancelled:
                continue
            key, off, size = target
            objs.offsets.append(off)
            objs.sizes.append(size)
            objs.blocks.append(sv.block_ids)
            objs.skips.append(0)
            objs.keys.append(key)
            self.counters["saved_raw_bytes"] += len(sv.block_ids) * self.layouts[name].page_bytes
        if objs.offsets:
            job.device_saves.append(self.device_path.save_layer(arena, objs, after))

    def _seal_device_saves(self, job: _SaveJob) -> None:
        """Headers go in once a layer's copy is done, with the sums it computed."""
        arena = self._arena_tensor()
        for q in job.device_saves:
            sums = self.device_path.finish_save(q)
            layout, codec = self.layouts[q.objs.name], self.codecs[q.objs.name]
            for key, off, size, wsum in zip(q.objs.keys, q.objs.offsets, q.objs.sizes, sums):
                seal(arena[off:off + size], size - HEADER_BYTES, layout, key, codec, self.cfg.verify_checksum,
                     wsum=wsum)

    def wait_for_save(self, meta: StepMetadata | None) -> None:
        self._drain_saves()
        if self.state_copies is not None and self.state_copies.pending:
            # A state layer never waited for its load: its kernel read the state before
            # the copy, so this step's tokens are wrong. A vLLM seam moved: stop loudly.
            raise seams.SeamError("ascend-store: deferred state copies of layers "
                                  f"{self.state_copies.outstanding()} never ran (docs/hybrid.md)")
        if self._waits or self._saves:
            self.step_hooks.append((self._waits, self._saves))
        if self._step_loads:
            self.load_step_layers.append(len(self._waited))
        self._waits = self._saves = 0
        self._waited = set()
        rpcs = self.backend.rpcs
        self.counters["max_rpcs_per_step"] = max(self.counters["max_rpcs_per_step"], rpcs - self._rpcs_seen)
        self._rpcs_seen = rpcs
        job = self._save_job(meta)
        self._save = None
        if job is None:
            return
        if not self.cfg.use_layerwise:
            after = self.device_path.dev.record() if self.device_path is not None else None
            job.futures += [self._save_thread.submit(self._run_save_layer, job, n, after) for n in self.order]
        # The save thread commits right after the copies, so objects become visible even
        # if the engine goes idle; only the wait for the copies may be deferred.
        job.futures.append(self._save_thread.submit(self._run_commit, job))
        if self.defer_drain:
            self._draining = job
        else:
            self._finish_save(job)

    def _drain_saves(self) -> None:
        job, self._draining = self._draining, None
        if job is not None:
            self.counters["deferred_drains"] += 1
            self._finish_save(job)

    def _finish_save(self, job: _SaveJob) -> None:
        if wait(job.futures, timeout=self.cfg.load_timeout_s).not_done:
            # Stop the copies before vLLM reuses the blocks; unpublished objects expire.
            job.cancelled = True
            log.warning("KV pool save did not finish in time; its objects expire unpublished")
            self.counters["save_errors"] += 1

    def _run_commit(self, job: _SaveJob) -> None:
        if job.cancelled:
            return
        sizes = {key: size for key, _, size in job.slots.values()}
        done = [k for k in sizes if k not in job.failed]
        try:
            if job.device_saves:
                self._seal_device_saves(job)
            self.backend.abort(sorted(job.failed))
            for key, status in zip(done, self.backend.commit(done)):
                if status is Status.OK:
                    self.counters["saved_objects"] += 1
                    self.counters["saved_bytes"] += sizes[key]
        except BackendUnavailable:
            self.counters["save_errors"] += 1

    def stats(self) -> AscendStoreStats:
        now = time.monotonic()
        if now - self._pool_stats_at >= 5.0:  # pool occupancy: one call every 5 s at most
            self._pool_stats_at = now
            try:
                s = self.backend.stats()
                self.counters["pool_used_bytes"] = s["used_bytes"]
                self.counters["pool_capacity_bytes"] = s["capacity"]
                self.counters["pool_evictions"] = s["evictions"]
            except BackendUnavailable:
                pass
        self.counters["rpcs"] = self.backend.rpcs
        return AscendStoreStats(self.counters.take())

    def shutdown(self) -> None:
        self._drain_saves()
        self._load_thread.shutdown(wait=True, cancel_futures=True)
        self._save_thread.shutdown(wait=True, cancel_futures=True)
        self._arena = None
        if self.device_path is not None:
            self.device_path.close()
        self.backend.close()
