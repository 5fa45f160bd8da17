"""The worker's batched transfer path (CUDA; NPU through device/platform.py; CPU for tests).

The pool's arena is registered as pinned host memory. Loads move in *batches* of a
group's layers of one page shape (up to ``BATCH_BYTES``; a layer of a long prompt is a
batch of its own): the copy engine moves the batch's parts of every object into device
staging (a chunk object holds its layers' parts back to back, so one 2D DMA per run of
equally spaced objects covers the batch), then one kernel scatters every layer's pages
into the paged caches, summing every word on the way (kernels.load_rows: one plan per
step, shifted per layer and object). Kernels touch device memory only, so they hold the
SMs for microseconds, not for the transfer (docs/benchmarks.md). The compute stream
never waits on the host:

- load: ``batches`` splits a step's layers of a group into batches
  (device_work.BatchLoad; one zeroed sums tensor), plans the first two (one upload of
  the index arrays the device lacks) and starts their DMAs; ``queue_batch`` plans a
  later batch, queues it and returns its event, and ``wait_for_layer_load`` makes the
  compute stream wait on it. DMAs run on the stage stream into two staging buffers used
  in turn, kernels on the load stream, so the link fills one buffer while a kernel
  drains the other. ``check_loads`` copies the step's sums back once and compares them
  in one numpy pass; a mismatch becomes a failed load.
- save (device_saves.py): a layer's gather kernel (gather stream) starts from an event
  the compute stream records after the layer wrote its KV, its DMAs follow on the save
  stream, so a gather runs under the DMA of the layer before. Headers (with the sums)
  are written once the copies are done, before the objects are committed.

int8 layers batch and take the same DMAs (half the bytes), dequantized by one kernel per
batch and quantized by whole-class tensor ops (int8_path.py). vLLM-free, so
``benchmarks/layerwise.py`` drives exactly this code.
"""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import torch

from ascend_store.common.checksum import fold_array
from ascend_store.common.transfer import HEADER_BYTES, LayerLayout
from ascend_store.device import int8_path, kernels
from ascend_store.device.device_saves import DeviceSaves
from ascend_store.device.device_work import BATCH_BYTES, BatchLoad, LayerObjects, QueuedLoad
from ascend_store.device.platform import Device
from ascend_store.device.segments import (
    WORD,
    StepPages,
    dma_plans,
    host_array,
    page_plan,
    storage_words,
    to_device_rows,
)


class DevicePath(DeviceSaves):
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
        # Consecutive layers of one kind share a batch: raw of one page shape, or int8 of one
        # payload size, cache shape, dtype and strides (one kernel reads them all).
        self.kinds = {name: ("raw", shape) for name, shape in self.shapes.items()}
        for name, c in self.int8.items():
            view = self.blocks_view[name]
            self.kinds[name] = ("int8", c.payload_bytes(layouts[name], 1), tuple(view.shape), view.stride(),
                                view.dtype)
        ptrs = {name: self.words[name].data_ptr() for name in self.plans}
        low = min(ptrs, key=ptrs.get, default=None)
        self.base_words = self.words[low] if low is not None else None
        self.bases = {name: (ptrs[name] - ptrs[low]) // WORD + self.plans[name].origin // WORD
                      for name in self.plans}
        self.load_stream = self.dev.stream()
        self.stage_stream = self.dev.stream()  # loads' DMAs, ahead of the load stream's kernels
        self.save_stream = self.dev.stream()  # saves' DMAs, behind the gather stream's kernels
        self.gather_stream = self.dev.stream()
        self.check_stream = self.dev.stream()  # loads' checksums come back here
        self._ring: list[list] = [[None, None], [None, None]]  # staging buffer, event of its last reader
        self._next = 0
        # Planning and queueing share the staging ring and its turn (``_next``): an
        # off-step load's thread queues beside the step's load and the forward's thread.
        self._lock = threading.RLock()
        self._layer_bases: dict[tuple[str, ...], torch.Tensor] = {}  # a batch's layers -> their cache bases
        self._arena: tuple[object, object, torch.Tensor] | None = None  # (epoch, view, bytes)

    def warm_up(self) -> None:
        """Compile the copy kernels now, not in the step of the first hit or save (a compile
        the machine's Triton cache lacks takes hundreds of ms). Each kernel runs once per
        variant a step can need: a one-segment plan whose pointers are aligned and whose
        word counts are those of the real steps (to_device_rows; the per-step counts are
        not specialized on). Nothing in the caches is written: a load's segment is read for
        its checksum only, a save's goes nowhere, an int8 load only sums."""
        if self.dev.type != "cuda" or kernels.triton is None:
            return
        dev, i64 = self.dev.device, torch.int64
        zeros = lambda *shape: torch.zeros(shape, dtype=i64, device=dev)  # noqa: E731
        loads = {plan.seg_bytes // WORD for plan in self.plans.values()}
        saves, int8 = {}, {}  # one layer per variant
        for name, plan in self.plans.items():
            src = self.words[name][plan.origin // WORD:]
            saves.setdefault((plan.seg_bytes // WORD, src.data_ptr() % 16), src)
        for name, codec in self.int8.items():
            int8.setdefault((codec.payload_bytes(self.layouts[name], 1), self.layouts[name].kv_dims), name)
        with self.dev.use(self.save_stream):
            for seg_words in loads:
                segs = to_device_rows([np.zeros(1), np.zeros(1), np.full(1, -1)], dev)
                obj_base, layer_base = to_device_rows([np.zeros(1), np.zeros(1)], dev)
                kernels.load_rows(zeros(seg_words), self.base_words, segs, obj_base.view(1, 1), layer_base,
                                  zeros(1, 1, 2), seg_words)
            for (seg_words, _), src in saves.items():
                segs = to_device_rows([np.zeros(1), np.full(1, -1), np.zeros(1), np.zeros(1)], dev)
                kernels.copy_segments_sum(src, zeros(seg_words), segs, zeros(1, 2), seg_words)
            for (per_block, kv_dims), name in int8.items():
                plan = int8_path.int8_plan(StepPages.of([[]], [0], [1]), np.ones(1, dtype=np.int64),
                                           per_block, kv_dims[1])
                rows = int8_path.int8_rows([self.blocks_view[name]], np.zeros((1, 1), dtype=np.int64))
                staging = torch.zeros(HEADER_BYTES + per_block, dtype=torch.uint8, device=dev)
                int8_path.load_layers(staging, plan, rows, zeros(1, 1, 2))
        self.save_stream.synchronize()

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
    def batches(self, layers: list[LayerObjects], arena: torch.Tensor | None = None) -> list[BatchLoad]:
        """A group's layers (model order) in the batches they load in: consecutive layers of
        one kind (``kinds``) and one step plan, until a batch holds ``BATCH_BYTES``. The first
        two batches are planned now, the others when queued (a batch costs the host ~15-30 us
        to plan: planning all of a step's 28 first would hold the link idle for most of a
        batch). With ``arena`` (the step's only group) the first batch's DMAs start once it is
        planned, the second's once the uploads
        its kernel needs are queued (copies of one direction can share a copy engine's queue
        whatever their streams: an upload behind both batches held the first kernel back a
        whole batch); their kernels follow in ``queue_batch``."""
        with self._lock:
            if not layers:
                return []
            parts = np.array([o.offsets for o in layers], dtype=np.int64).reshape(len(layers), -1)
            sizes = np.array([o.sizes for o in layers], dtype=np.int64).reshape(parts.shape)
            firsts: list[int] = []  # each batch's first layer
            held = 0
            for i, (objs, nbytes) in enumerate(zip(layers, sizes.sum(axis=1).tolist())):
                last = layers[firsts[-1]] if firsts else None
                if not (last is not None and held < BATCH_BYTES
                        and self.kinds[objs.name] == self.kinds[last.name] and objs.plan() is last.plan()):
                    firsts.append(i)
                    held = 0
                held += nbytes
            ends = firsts[1:] + [len(layers)]
            planned = [BatchLoad(layers[a:b], parts[a:b], sizes[a:b]) for a, b in zip(firsts, ends)]
            head = planned[:len(self._ring)]
            early = head if arena is not None and self.dev.is_accelerator else []
            self._plan_dmas(head[:1])
            for bl in early[:1]:
                self._stage(arena, bl)
            # One zeroed sums tensor for the step's batches: a row per [layer, object].
            with self.dev.use(self.load_stream):
                sums = torch.zeros((parts.size, 2), dtype=torch.int64, device=self.dev.device)
            for bl, a in zip(planned, firsts):
                bl.sums_at = (sums, a * parts.shape[1])
            self._plan_dmas(head[1:])
            self._plan_kernels(head)
            for bl in early[1:]:
                self._stage(arena, bl)
            return planned

    def _plan_kernels(self, bls: list[BatchLoad]) -> None:
        self._plan_raw([bl for bl in bls if bl.layers[0].name not in self.int8])
        self._plan_int8([bl for bl in bls if bl.layers[0].name in self.int8])

    def _plan_int8(self, bls: list[BatchLoad]) -> None:
        """Plan int8 batches: the step's dequantizing plan (a step's batches of one shape
        share one) and where each layer's objects and cache are; on CUDA their index arrays
        go up in one copy per batch."""
        for bl in bls:
            objs, sizes = bl.layers[0], bl.sizes[0]
            layout = self.layouts[objs.name]
            per_block = self.int8[objs.name].payload_bytes(layout, 1)
            planner = objs.plan()
            bl.int8 = planner.cached(
                ("int8", layout.kv_dims, sizes.tobytes()),
                lambda: int8_path.int8_plan(planner.pages, (sizes - HEADER_BYTES) // per_block, per_block,
                                            layout.kv_dims[1]))
            bl.rows = int8_path.int8_rows([self.blocks_view[o.name] for o in bl.layers], bl.starts)
            if self.dev.type == "cuda":  # the kernel's index arrays (elsewhere torch ops read numpy)
                with self.dev.use(self.load_stream):
                    int8_path.upload(bl.int8, bl.rows, self.dev.device)

    def _plan_raw(self, raw: list[BatchLoad]) -> None:
        """Plan raw batches: row plans, where each [layer, object] payload starts. On CUDA
        one upload of the index arrays the device lacks: a plan's segments and each payload
        layout once a step (a step's one-layer batches share one), a batch's cache bases
        once, so batches planned after the first two seldom upload anything."""
        for bl in raw:
            bl.plan = bl.layers[0].plan().rows(self.shapes[bl.layers[0].name])
            bl.obj_base = (bl.starts + HEADER_BYTES) // WORD  # [layer, object] payload start, words
        if self.dev.type != "cuda" or not raw:  # torch ops stand in for the kernel (CPU, NPU)
            return
        plans = {id(bl.plan): bl.plan for bl in raw if bl.plan.device_segs is None}
        keys = [(bl.obj_base.shape, bl.obj_base.tobytes()) for bl in raw]
        placed = {}  # payload layouts a batch's step planner lacks: (planner's, layout) -> (its dict, batch)
        for bl, key in zip(raw, keys):
            payloads = bl.layers[0].plan().payloads
            if key not in payloads:
                placed.setdefault((id(payloads), key), (payloads, bl))
        names = [tuple(o.name for o in bl.layers) for bl in raw]
        bases = {n: np.asarray([self.bases[x] for x in n], dtype=np.int64)
                 for n in names if n not in self._layer_bases}
        rows = [a for p in plans.values() for a in (p.obj_of_seg, p.payload_word, p.cache_word)]
        rows += [bl.obj_base.reshape(-1) for _, bl in placed.values()] + list(bases.values())
        if rows:
            with self.dev.use(self.load_stream):
                got = iter(to_device_rows(rows, self.dev.device))
            for p in plans.values():
                p.device_segs = [next(got) for _ in range(3)]
            for (_, key), (payloads, _) in placed.items():
                payloads[key] = next(got).view(key[0])
            self._layer_bases.update((n, next(got)) for n in bases)
        for bl, key, n in zip(raw, keys, names):
            bl.obj_base = bl.layers[0].plan().payloads[key]
            bl.layer_base = self._layer_bases[n]

    def _plan_dmas(self, bls: list[BatchLoad]) -> None:
        """On an accelerator, each batch's DMAs into staging (kept in the step's planner, as
        saves keep theirs) and where each [layer, object] part starts in staging
        (elsewhere: in the arena, which the copy reads)."""
        for bl in bls:
            bl.starts = bl.parts
            if self.dev.is_accelerator:
                planned = dma_plans([(bl.parts, bl.sizes)], bl.layers[0].plan().dmas)
                ((bl.runs, bl.staged, bl.starts),) = planned

    def queue_batch(self, arena: torch.Tensor, bl: BatchLoad) -> QueuedLoad:
        """Queue a batch's copy from the arena into the caches (DMAs on the stage stream,
        the kernel on the load stream), planning it first unless ``batches`` did; the
        forward may use its layers once its stream waits on the returned ``done`` event."""
        with self._lock:
            if bl.plan is None and bl.int8 is None:
                self._plan_dmas([bl])
                self._plan_kernels([bl])
            sums, row = bl.sums_at
            rows = sums[row:row + bl.parts.size]
            with self.dev.use(self.load_stream):
                bl.sums = rows.view(*bl.parts.shape, 2)
                if bl.int8 is not None:
                    self._load_int8(arena, bl)
                else:
                    self._load_raw(arena, bl)
                done = self.dev.record(self.load_stream)
                if bl.slot is not None:
                    bl.slot[1] = done  # the buffer's next DMA waits for this kernel
                return QueuedLoad(bl.layers, done, bl.sums, bl.sums_at)

    def check_loads(self, qs: list[QueuedLoad], verify: bool) -> list[list[list[int]]]:
        """Wait for a step's queued loads; per load, per layer, the indexes of objects whose
        word checksum does not match their header. Their blocks must be reported as failed
        loads (vLLM then recomputes them and drops the step's output for their requests), so
        a bad object costs a recompute, never a wrong token. The step's sums come back in
        one copy and are folded and compared in one numpy pass. The copy runs on a stream of
        its own once the loads' events have passed: on the load stream it would wait for
        every load queued after them (an off-step load's), on the compute stream for the
        forward."""
        for q in qs:
            if q.done is not None:
                q.done.synchronize()
        out = [[[] for _ in q.layers] for q in qs]
        if not verify or not qs:
            return out
        with self.dev.use(self.check_stream):
            steps = {id(q.sums_at[0]): q.sums_at[0] for q in qs}
            host = {k: host_array(t) for k, t in steps.items()}
        spans = [(host[id(t)], at, q.sums.numel() // 2) for q in qs for t, at in [q.sums_at]]
        u = np.concatenate([h[at:at + n] for h, at, n in spans]).view(np.uint64)
        folded = fold_array(u[:, 0], u[:, 1])
        layers = [(i, r, objs, q.sums.shape[-2]) for i, q in enumerate(qs) for r, objs in enumerate(q.layers)]
        stored = np.concatenate([np.full(n, -1, dtype=np.int64) if objs.stored is None
                                 else np.asarray(objs.stored, dtype=np.int64) for _, _, objs, n in layers])
        bad = np.flatnonzero((stored >= 0) & (stored != folded))
        if bad.size:  # rare: find each one's load, layer and object
            ends = np.cumsum([n for *_, n in layers])
            for at in bad.tolist():
                k = int(np.searchsorted(ends, at, side="right"))
                i, r, _, n = layers[k]
                out[i][r].append(at - int(ends[k]) + n)
        return out

    def _load_raw(self, arena: torch.Tensor, bl: BatchLoad) -> None:
        """Queue a planned batch of raw layers: on an accelerator from staging, one kernel
        for the batch; elsewhere torch ops a layer at a time (on CPU from the arena)."""
        plan = bl.plan
        src = self._staged(arena, bl) if self.dev.is_accelerator else arena
        if self.dev.type != "cuda":
            kernels.load_rows_torch(src.view(torch.int64), [self.words[o.name] for o in bl.layers],
                                    (plan.obj_of_seg, plan.payload_word, plan.cache_word), bl.obj_base,
                                    [self.plans[o.name].origin // WORD for o in bl.layers], bl.sums,
                                    plan.seg_words)
        else:
            kernels.load_rows(src.view(torch.int64), self.base_words, plan.device_segs, bl.obj_base,
                              bl.layer_base, bl.sums, plan.seg_words)

    def _stage(self, arena: torch.Tensor, bl: BatchLoad) -> None:
        """Queue a batch's DMAs into the next staging buffer (on the stage stream)."""
        bl.slot, bl.staging = self._ring_slot(bl.staged)
        for at, width, src, pitch, count in bl.runs:
            self.dev.copy_2d(bl.staging, at, width, arena, src, pitch, width, count, self.stage_stream)
        bl.landed = self.dev.record(self.stage_stream)

    def _staged(self, arena: torch.Tensor, bl: BatchLoad) -> torch.Tensor:
        """The batch's staging buffer (its DMAs queued now unless already), with the load
        stream waiting for them."""
        if bl.staging is None:
            self._stage(arena, bl)
        self.dev.wait(bl.landed, self.load_stream)
        return bl.staging

    def _ring_slot(self, nbytes: int) -> tuple[list, torch.Tensor]:
        """The next of two staging buffers, once the kernel that last read it is done, so
        the link fills one while a kernel drains the other (grown to the largest batch
        seen; taken in the order the batches' kernels are queued)."""
        self._next = (self._next + 1) % len(self._ring)
        entry = self._ring[self._next]
        if entry[0] is None or entry[0].numel() < nbytes:
            if entry[0] is not None:  # still read or written by queued work: free it after that
                entry[0].record_stream(self.stage_stream)
            entry[0] = torch.empty(nbytes, dtype=torch.uint8, device=self.dev.device)
        if entry[1] is not None:
            self.dev.wait(entry[1], self.stage_stream)
        return entry, entry[0][:nbytes]

    def _load_int8(self, arena: torch.Tensor, bl: BatchLoad) -> None:
        """Dequantize a planned batch of int8 layers into their caches (one kernel,
        int8_path.py), adding the payloads' word sums per [layer, object]."""
        src = self._staged(arena, bl) if self.dev.is_accelerator else arena
        int8_path.load_layers(src, bl.int8, bl.rows, bl.sums)
