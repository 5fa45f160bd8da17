"""The worker's batched transfer path (CUDA; NPU through device.py; CPU for tests).

The pool's arena is registered as pinned host memory. Loads move in *batches* of a
group's layers of one page shape (up to ``BATCH_BYTES``; a layer of a long prompt is a
batch of its own), each in two parts: the copy engine moves the batch's parts of every
object between the arena and device memory (a chunk object holds its layers' parts back
to back, so one 2D DMA per run of equally spaced objects covers the whole batch), and one
kernel scatters the pages of every layer of the batch into the paged caches, summing
every word on the way (kernels.load_rows: one plan per step, shifted per layer and per
object). The kernel only touches device memory, so it takes the SMs for microseconds; a
kernel reading the arena over the link directly would hold SMs for the whole transfer
and slow the forward it is meant to hide behind (measured: docs/benchmarks.md). The
compute stream never waits on the host:

- load: ``queue_batch`` queues a batch's copy and returns its event, with no host wait;
  the worker queues the batches before the forward or as it goes (``queue_window``) and
  ``wait_for_layer_load`` makes the compute stream wait on the event of that layer's
  batch. ``check_loads`` compares the
  sums once the copies are done (at the end of the step), and a mismatch becomes a failed
  load. The DMAs run on a stage stream into two staging buffers used in turn, the
  kernels on the load stream: the copy engine fills one buffer while a kernel drains the
  other. The host's work per step grows with the number of batches, not of layers.
- save: the copy of a layer starts from an event recorded on the compute stream right
  after the layer wrote its KV; the headers (with the sums the copy accumulated) are
  written when the copy is done, before the objects are committed.

Layers stored with the int8 codec take the same DMAs (half the bytes), a batch each;
their pages are dequantized by one kernel per layer and quantized by whole-class tensor
ops (int8_path.py), with word sums per object.

vLLM-free, so ``benchmarks/layerwise.py`` drives exactly this code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ascend_store import int8_path, kernels
from ascend_store.device import Device
from ascend_store.segments import (
    WORD,
    CopyPlanner,
    LayerCopy,
    RowPlan,
    StepPages,
    dma_runs,
    fold_alike,
    page_plan,
    run_copy,
    stage_layout,
    storage_words,
    to_device,
)
from ascend_store.transfer import HEADER_BYTES, LayerLayout

# Layers are added to a load batch until it holds this much: a DMA this long runs at
# ~95% of the link (shorter ones lose to their fixed cost, docs/benchmarks.md), and each
# batch costs the host a DMA, a kernel launch and an event. A longer layer goes alone, so
# the forward can start on the first layer while the rest are still on the link.
BATCH_BYTES = 32 * 2**20
# A step computing this many tokens has a forward long enough (~0.5 ms a layer for a 7B
# model on an H200) to queue each batch from the wait of the layer before it.
LAZY_QUEUE_TOKENS = 512


def queue_window(new_tokens: int, layers: int, load_window: int = 0) -> int:
    """How many layers' copies are queued ahead of the forward: ``load_window``; when 0,
    every layer for a step that computes few tokens (its forward hides nothing: the link
    starts on everything at once), else one (each batch costs the host ~0.3 ms, so
    queueing them all first delays the forward's first kernel by that much per layer,
    measured in benchmarks/layerwise.py; the forward's own layers keep the host ahead of
    the link instead)."""
    if load_window:
        return load_window
    return 1 if new_tokens >= LAZY_QUEUE_TOKENS else layers


@dataclass
class LayerObjects:
    """One layer's objects (its parts of a step's chunk objects): arena offsets, sizes,
    block ids, pages to skip, names (for errors; for saves without ``fps``, the keys the
    headers bind to), for loads the word checksum each header carries (-1: none, e.g. a
    CRC32 already checked on the host), and the step's planner, which every layer of a
    group shares (built from ``blocks`` and ``skips`` when not given)."""

    name: str
    offsets: list[int] | np.ndarray
    sizes: list[int] | np.ndarray
    blocks: list[list[int]]
    skips: list[int]
    keys: list[str]
    stored: list[int] | np.ndarray | None = None
    planner: CopyPlanner | None = None
    fps: np.ndarray | None = None  # saves: the headers' fingerprints, when precomputed

    def plan(self) -> CopyPlanner:
        if self.planner is None:
            self.planner = CopyPlanner(StepPages.of(self.blocks, self.skips))
        return self.planner


@dataclass
class QueuedLoad:
    layers: list[LayerObjects]  # the batch (int8: one layer)
    done: object  # device event (None on CPU, where the copy is done on return)
    sums: torch.Tensor  # raw: [layers, segments, 2] (fold with ``plan``); int8: [objects, 2]
    plan: RowPlan | None


@dataclass
class QueuedSave:
    objs: LayerObjects
    done: object  # device event
    sums: torch.Tensor
    copy: LayerCopy | None
    staging: object = None  # device buffers kept alive until the copy is done


class DevicePath:
    CODECS = ("raw", "int8")

    def __init__(self, device: torch.device, layouts: dict[str, LayerLayout], codecs: dict | None = None):
        self.dev = Device(device)
        self.layouts = layouts
        # int8 layers are quantized and dequantized on the device, whole layers at once.
        self.int8 = {name: c for name, c in (codecs or {}).items() if c.name == "int8"}
        if any(c.payload_bytes(layouts[name], 1) % WORD for name, c in self.int8.items()):
            raise ValueError("int8 payloads are not a whole number of 8-byte words")
        self.blocks_view = {name: layouts[name].canonical_blocks() for name in self.int8}
        self.plans = {name: page_plan(layout) for name, layout in layouts.items() if name not in self.int8}
        words = {}
        for layout in layouts.values():  # layers often share one buffer: one view of it
            storage = layout.tensor.untyped_storage()
            if storage.data_ptr() not in words:
                words[storage.data_ptr()] = storage_words(layout.tensor)
        self.words = {name: words[lay.tensor.untyped_storage().data_ptr()] for name, lay in layouts.items()}
        # A batch's layers read one plan: it holds their page shape (the plan at origin 0),
        # each layer adds where its cache starts, in words from the lowest cache storage.
        self.shapes = {name: replace(plan, origin=0) for name, plan in self.plans.items()}
        ptrs = {name: self.words[name].data_ptr() for name in self.plans}
        low = min(ptrs, key=ptrs.get, default=None)
        self.base_words = self.words[low] if low is not None else None
        self.bases = {name: (ptrs[name] - ptrs[low]) // WORD + self.plans[name].origin // WORD
                      for name in self.plans}
        self.load_stream = self.dev.stream()
        self.stage_stream = self.dev.stream()  # loads' DMAs, ahead of the load stream's kernels
        self.save_stream = self.dev.stream()
        self._ring: list[list] = [[None, None], [None, None]]  # staging buffer, event of its last reader
        self._next = 0
        self._slot: list | None = None
        self._arena: tuple[object, object, torch.Tensor] | None = None  # (epoch, view, bytes)

    # -- the arena ----------------------------------------------------------------
    def arena(self, epoch, view) -> torch.Tensor:
        """The arena as a uint8 host tensor, registered as pinned once per pool epoch."""
        if self._arena is None or self._arena[0] != epoch:
            if self._arena is not None:
                self.dev.unpin(self._arena[1])
            self.dev.pin(view)
            host = torch.frombuffer(view, dtype=torch.uint8)
            self._arena = (epoch, view, host)
        return self._arena[2]

    def close(self) -> None:
        if self._arena is not None:
            self.dev.unpin(self._arena[1])
            self._arena = None

    # -- loads --------------------------------------------------------------------
    def batches(self, layers: list[LayerObjects]) -> list[list[LayerObjects]]:
        """A group's layers (model order) in the batches they load in: consecutive raw
        layers of one page shape and one step plan, until a batch holds ``BATCH_BYTES``;
        int8 layers alone."""
        out: list[list[LayerObjects]] = []
        held = 0
        for objs in layers:
            last = out[-1][0] if out else None
            if (last is not None and held < BATCH_BYTES and objs.name not in self.int8
                    and last.name not in self.int8 and self.shapes[objs.name] == self.shapes[last.name]
                    and objs.plan() is last.plan()):
                out[-1].append(objs)
            else:
                out.append([objs])
                held = 0
            held += int(np.sum(objs.sizes))
        return out

    def queue_batch(self, arena: torch.Tensor, batch: list[LayerObjects]) -> QueuedLoad:
        """Queue a batch's copy from the arena into the caches (DMAs on the stage stream,
        the kernel on the load stream); the forward may use its layers once its stream
        waits on the returned ``done`` event."""
        with self.dev.use(self.load_stream):
            if batch[0].name in self.int8:
                plan, sums = self._load_int8(arena, batch[0])
            else:
                plan, sums = self._load_raw(arena, batch)
            done = self.dev.record(self.load_stream)
            if self._slot is not None:
                self._slot[1] = done  # the slot's next DMA waits for this kernel
                self._slot = None
            return QueuedLoad(batch, done, sums, plan)

    def check_loads(self, qs: list[QueuedLoad], verify: bool) -> list[list[list[int]]]:
        """Wait for a step's queued loads; per load, per layer, the indexes of objects whose
        word checksum does not match their header. Their blocks must be reported as failed
        loads (vLLM then recomputes them and drops the step's output for their requests), so
        a bad object costs a recompute, never a wrong token. Loads alike (sharing a plan)
        come back to the host in one copy and are folded in one numpy pass."""
        for q in qs:
            if q.done is not None:
                q.done.synchronize()
        out = [[[] for _ in q.layers] for q in qs]
        if not verify:
            return out
        with self.dev.use(self.load_stream):  # on the compute stream, the copy would wait for the forward
            got = fold_alike([(q.sums, q.plan, len(q.layers[0].offsets)) for q in qs])
        for q, per_layer, sums in zip(qs, out, got):
            for r, objs in enumerate(q.layers):
                if objs.stored is not None:
                    stored = np.asarray(objs.stored, dtype=np.int64)
                    per_layer[r] = np.flatnonzero((stored >= 0) & (stored != sums[r])).tolist()
        return out

    def _load_raw(self, arena: torch.Tensor, batch: list[LayerObjects]) -> tuple[RowPlan, torch.Tensor]:
        """Queue a batch of raw layers. On an accelerator the copy engine moves their parts
        into device memory, then one kernel scatters every layer's pages into its cache and
        sums them; kernels never wait on the link, so compute keeps every SM. Elsewhere torch
        ops copy the pages a layer at a time (on CPU straight from the arena)."""
        plan = batch[0].plan().rows(self.shapes[batch[0].name])
        parts = np.stack([np.asarray(o.offsets, dtype=np.int64) for o in batch])
        sizes = np.stack([np.asarray(o.sizes, dtype=np.int64) for o in batch])
        src, starts = self._stage(arena, parts, sizes)
        obj_base = (starts + HEADER_BYTES) // WORD  # [layer, object] payload start, words
        n = len(plan.obj_of_seg)
        if self.dev.device.type != "cuda":
            sums = torch.empty((len(batch), n, 2), dtype=torch.int64, device=self.dev.device)
            kernels.load_rows_torch(src.view(torch.int64), [self.words[o.name] for o in batch],
                                    (plan.obj_of_seg, plan.payload_word, plan.cache_word), obj_base,
                                    [self.plans[o.name].origin // WORD for o in batch], sums, plan.seg_words)
            return plan, sums
        if plan.device_segs is None:
            plan.device_segs = to_device(np.stack([plan.obj_of_seg, plan.payload_word, plan.cache_word]),
                                         self.dev.device)
        layer_base = np.asarray([self.bases[o.name] for o in batch], dtype=np.int64)
        bases = to_device(np.concatenate([obj_base.reshape(-1), layer_base]), self.dev.device)  # per batch
        sums = torch.zeros((len(batch), n, 2), dtype=torch.int64, device=self.dev.device)
        k = obj_base.size
        kernels.load_rows(src.view(torch.int64), self.base_words, plan.device_segs,
                          bases[:k].view(obj_base.shape), bases[k:], sums, plan.seg_words)
        return plan, sums

    def _stage(self, arena: torch.Tensor, parts: np.ndarray,
               sizes: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """A batch's parts ([layer, object] arena offsets and sizes) in device memory, and
        where each one starts there (``segments.stage_layout``): one 2D DMA per run of
        equally spaced spans. On CPU: the arena itself."""
        if not self.dev.is_accelerator:
            return arena, parts
        spans, widths, staged, starts = stage_layout(parts, sizes)
        slot = -(-widths // WORD) * WORD
        staging = self._ring_slot(int(slot.sum()))
        with self.dev.use(self.stage_stream):
            for g in range(len(spans)):
                for first, count, pitch in dma_runs(spans[g], widths[g]):
                    w, at = int(slot[g, first]), int(staged[g, first])
                    self.dev.copy_2d(staging, at, w, arena, int(spans[g, first]), pitch, w, count)
            self.dev.wait(self.dev.record(self.stage_stream), self.load_stream)
        return staging, starts

    def _ring_slot(self, nbytes: int) -> torch.Tensor:
        """The next of two staging buffers, once the kernel that last read it is done:
        while one layer's kernel reads a buffer the copy engine fills the other, so the
        link never waits for a kernel. The buffers grow to the largest layer seen."""
        self._next = (self._next + 1) % len(self._ring)
        entry = self._ring[self._next]
        if entry[0] is None or entry[0].numel() < nbytes:
            if entry[0] is not None:  # still read or written by queued work: free it after that
                entry[0].record_stream(self.stage_stream)
            entry[0] = torch.empty(nbytes, dtype=torch.uint8, device=self.dev.device)
        if entry[1] is not None:
            self.dev.wait(entry[1], self.stage_stream)
        self._slot = entry
        return entry[0][:nbytes]

    def _load_int8(self, arena: torch.Tensor, objs: LayerObjects):
        """Dequantize a layer's int8 objects into the cache (one kernel, int8_path.py);
        the payloads' word sums come back per object."""
        sizes = np.asarray(objs.sizes, dtype=np.int64)
        src, starts = self._stage(arena, np.asarray(objs.offsets, dtype=np.int64)[None], sizes[None])
        starts = starts[0]
        layout = self.layouts[objs.name]
        per_block = self.int8[objs.name].payload_bytes(layout, 1)
        planner = objs.plan()
        plan = planner.cached(
            ("int8", layout.kv_dims, starts.tobytes(), sizes.tobytes()),
            lambda: int8_path.int8_plan(planner.pages, starts, (sizes - HEADER_BYTES) // per_block, per_block,
                                        layout.kv_dims[1]))
        return None, int8_path.load_layer(src, self.blocks_view[objs.name], plan)

    # -- saves --------------------------------------------------------------------
    def save_layer(self, arena: torch.Tensor, objs: LayerObjects, after) -> QueuedSave:
        """Queue the copy of one layer's objects into their arena slots once ``after``
        (an event on the compute stream) has passed. On an accelerator a kernel gathers
        the pages into device memory (summing them) and the copy engine moves each
        payload into its slot."""
        plan = self.plans.get(objs.name)
        with self.dev.use(self.save_stream):
            self.dev.wait(after, self.save_stream)
            if objs.name in self.int8:
                return self._save_int8(arena, objs)
            if not self.dev.is_accelerator:
                copy = objs.plan().layer(plan, np.asarray(objs.offsets, dtype=np.int64) + HEADER_BYTES,
                                         load=False)
                sums = run_copy(copy, self.words[objs.name], arena.view(torch.int64), self.dev.device)
                return QueuedSave(objs, None, sums, copy)
            offs = np.asarray(objs.offsets, dtype=np.int64)
            sizes = np.asarray(objs.sizes, dtype=np.int64)
            slot = -(-sizes // WORD) * WORD
            starts = np.cumsum(slot) - slot  # parts in staging as in the arena: headers too
            staging = torch.empty(int(slot.sum()), dtype=torch.uint8, device=self.dev.device)
            copy = objs.plan().layer(plan, starts + HEADER_BYTES, load=False)
            sums = run_copy(copy, self.words[objs.name], staging.view(torch.int64), self.dev.device)
            for first, count, pitch in dma_runs(offs, sizes):
                # Headers ride along in the 2D copy and are rewritten at the commit.
                width = int(slot[first])
                self.dev.copy_2d(arena, int(offs[first]), pitch, staging, int(starts[first]), width, width,
                                 count)
            done = self.dev.record(self.save_stream)
        return QueuedSave(objs, done, sums, copy, staging)

    def _save_int8(self, arena: torch.Tensor, objs: LayerObjects) -> QueuedSave:
        """Quantize a layer's blocks per size class of objects (whole-class tensor ops),
        sum the payloads, and move them into their slots with 2D copies."""
        codec, layout = self.int8[objs.name], self.layouts[objs.name]
        offsets = np.asarray(objs.offsets, dtype=np.int64)
        sizes = np.asarray(objs.sizes, dtype=np.int64)
        sums = torch.zeros((len(offsets), 2), dtype=torch.int64, device=self.dev.device)
        keep = []
        view = self.blocks_view[objs.name]
        for idx, rows, got in int8_path.quantize_classes(view, sizes, objs.plan().pages, codec, layout):
            sums[torch.from_numpy(idx).to(self.dev.device)] = got
            width = rows.shape[1]
            flat = rows.view(-1)
            for first, count, pitch in dma_runs(offsets[idx] + HEADER_BYTES, sizes[idx] - HEADER_BYTES):
                at = int(offsets[idx[first]]) + HEADER_BYTES
                self.dev.copy_2d(arena, at, pitch, flat, first * width, width, width, count)
            keep.append(rows)
        return QueuedSave(objs, self.dev.record(self.save_stream), sums, None, keep)

    def finish_saves(self, qs: list[QueuedSave]) -> list[np.ndarray]:
        """``finish_save`` for a step's layers at once (one numpy pass per shared plan)."""
        for q in qs:
            if q.done is not None:
                q.done.synchronize()
        with self.dev.use(self.save_stream):  # not behind the compute stream's queued work
            got = fold_alike([(q.sums, q.copy, len(q.objs.offsets)) for q in qs])
        return [g[0] for g in got]

    def finish_save(self, q: QueuedSave) -> list[int]:
        """Wait for a queued save; returns each object's folded word checksum."""
        return self.finish_saves([q])[0].tolist()
