"""The worker's batched transfer path (CUDA; NPU through device.py; CPU for tests).

The pool's arena is registered as pinned host memory. Each layer moves on a side stream
in two parts: the copy engine moves whole objects between the arena and device memory
(one DMA per run of adjacent slots), and one kernel (segments.py) scatters or gathers
their pages to or from the paged cache, summing every word on the way. The kernel only
touches device memory, so it takes the SMs for microseconds; a kernel reading the arena
over the link directly would hold SMs for the whole transfer and slow the forward it is
meant to hide behind (measured: docs/benchmarks.md). The compute stream never waits on
the host:

- load: ``queue_load`` queues a layer's copy and returns its event, with no host wait;
  the worker queues every layer before the forward and ``wait_for_layer_load`` makes the
  compute stream wait on that layer's event. ``check_load`` compares the sums once the
  copy is done (at the end of the step), and a mismatch becomes a failed load. The DMAs
  run on a stage stream into two staging buffers used in turn, the kernels on the load
  stream: the copy engine fills one buffer while a kernel drains the other.
- save: the copy of a layer starts from an event recorded on the compute stream right
  after the layer wrote its KV; the headers (with the sums the copy accumulated) are
  written when the copy is done, before the objects are committed.

Layers stored with the int8 codec take the same DMAs (half the bytes); their pages are
dequantized by one kernel per layer and quantized by whole-class tensor ops
(int8_path.py), with word sums per object.

vLLM-free, so ``benchmarks/layerwise.py`` drives exactly this code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ascend_store import int8_path
from ascend_store.checksum import fold_array, fold_sums
from ascend_store.device import Device
from ascend_store.segments import (
    WORD,
    CopyPlanner,
    LayerCopy,
    StepPages,
    host_array,
    object_sums,
    object_sums_many,
    page_plan,
    run_copy,
    storage_words,
)
from ascend_store.transfer import HEADER_BYTES, LayerLayout


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
    objs: LayerObjects
    done: object  # device event (None on CPU, where the copy is done on return)
    sums: torch.Tensor  # per segment (raw: fold with ``copy``) or per object (int8)
    copy: LayerCopy | None


@dataclass
class QueuedSave:
    objs: LayerObjects
    done: object  # device event
    sums: torch.Tensor
    copy: LayerCopy | None
    staging: object = None  # device buffers kept alive until the copy is done


def _folded(sums: torch.Tensor, copy: LayerCopy | None, n: int) -> list[int]:
    """Per-object checksums from a copy's per-segment sums, or from per-object sums."""
    return object_sums(copy, host_array(sums), n) if copy is not None else fold_sums(host_array(sums))


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
    def queue_load(self, arena: torch.Tensor, objs: LayerObjects) -> QueuedLoad:
        """Queue one layer's copy from the arena into the cache (DMA on the stage stream,
        kernel on the load stream); the forward may use the layer once its stream waits
        on the returned ``done`` event."""
        with self.dev.use(self.load_stream):
            copy, sums = self._load_layer(arena, objs)
            done = self.dev.record(self.load_stream)
            if self._slot is not None:
                self._slot[1] = done  # the slot's next DMA waits for this kernel
                self._slot = None
            return QueuedLoad(objs, done, sums, copy)

    def check_load(self, q: QueuedLoad, verify: bool) -> list[int]:
        """Wait for a queued load; the indexes of objects whose word checksum does not
        match their header. Their blocks must be reported as failed loads (vLLM then
        recomputes them and drops the step's output for their requests), so a bad object
        costs a recompute, never a wrong token."""
        if q.done is not None:
            q.done.synchronize()
        if not verify or q.objs.stored is None:
            return []
        got = np.asarray(_folded(q.sums, q.copy, len(q.objs.offsets)))
        stored = np.asarray(q.objs.stored, dtype=np.int64)
        return np.flatnonzero((stored >= 0) & (stored != got)).tolist()

    def check_loads(self, qs: list[QueuedLoad], verify: bool) -> list[list[int]]:
        """``check_load`` for a step's queued layers at once: layers whose copies share one
        page plan (a group's layers, normally) are folded together in one numpy pass."""
        for q in qs:
            if q.done is not None:
                q.done.synchronize()
        out: list[list[int]] = [[] for _ in qs]
        if not verify:
            return out
        got = self._sums_many([q for q in qs if q.objs.stored is not None])
        for i, q in enumerate(qs):
            if q.objs.stored is not None:
                stored = np.asarray(q.objs.stored, dtype=np.int64)
                out[i] = np.flatnonzero((stored >= 0) & (stored != got[id(q)])).tolist()
        return out

    def _sums_many(self, qs: list) -> dict[int, np.ndarray]:
        """Per queued copy (by id): its objects' folded checksums, from one copy back to
        the host per group of layers alike (sharing a page plan, or int8 with per-object
        sums of one object count)."""
        alike: dict[tuple, list] = {}
        for q in qs:
            key = (id(q.copy.obj_of_seg),) if q.copy is not None else ("int8", len(q.objs.offsets))
            alike.setdefault(key, []).append(q)
        out = {}
        for group in alike.values():
            first = group[0]
            sums = host_array(torch.stack([q.sums for q in group]))
            if first.copy is not None:
                got = object_sums_many(first.copy, sums, len(first.objs.offsets))
            else:
                u = sums.astype(np.int64).view(np.uint64)
                got = fold_array(u[..., 0], u[..., 1])
            for row, q in enumerate(group):
                out[id(q)] = got[row]
        return out

    def _load_layer(self, arena: torch.Tensor, objs: LayerObjects):
        """Queue one layer's copy. On an accelerator the copy engine moves the objects into
        device memory (one DMA per run of adjacent slots), then a kernel scatters their
        pages into the cache and sums them; kernels never wait on the link, so compute
        keeps every SM. On CPU the pages are copied straight from the arena."""
        if objs.name in self.int8:
            return self._load_int8(arena, objs)
        plan = self.plans[objs.name]
        if not self.dev.is_accelerator:
            copy = objs.plan().layer(plan, np.asarray(objs.offsets, dtype=np.int64) + HEADER_BYTES, load=True)
            return copy, run_copy(copy, arena.view(torch.int64), self.words[objs.name], self.dev.device)
        staging, staged = self._stage(arena, objs)
        copy = objs.plan().layer(plan, np.asarray(staged, dtype=np.int64) + HEADER_BYTES, load=True)
        return copy, run_copy(copy, staging.view(torch.int64), self.words[objs.name], self.dev.device)

    def _stage(self, arena: torch.Tensor, objs: LayerObjects) -> tuple[torch.Tensor, np.ndarray]:
        """The layer's parts in device memory, back to back, and where each one starts
        there. A layer's parts of equally spaced chunk objects (one request's chunks are
        usually saved together, so they sit side by side) move as one 2D DMA per run. On
        CPU: the arena itself."""
        if not self.dev.is_accelerator:
            return arena, np.asarray(objs.offsets, dtype=np.int64)
        offs = np.asarray(objs.offsets, dtype=np.int64)
        sizes = np.asarray(objs.sizes, dtype=np.int64)
        slot = -(-sizes // WORD) * WORD
        staged = np.cumsum(slot) - slot
        staging = self._ring_slot(int(slot.sum()))
        with self.dev.use(self.stage_stream):
            for first, count, pitch in _runs(offs, sizes):
                width = int(slot[first])
                at = int(staged[first])
                self.dev.copy_2d(staging, at, width, arena, int(offs[first]), pitch, width, count)
            self.dev.wait(self.dev.record(self.stage_stream), self.load_stream)
        return staging, staged

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
        src, starts = self._stage(arena, objs)
        starts = np.asarray(starts, dtype=np.int64)
        sizes = np.asarray(objs.sizes, dtype=np.int64)
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
            for first, count, pitch in _runs(offs, sizes):
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
            for first, count, pitch in _runs(offsets[idx] + HEADER_BYTES, sizes[idx] - HEADER_BYTES):
                at = int(offsets[idx[first]]) + HEADER_BYTES
                self.dev.copy_2d(arena, at, pitch, flat, first * width, width, width, count)
            keep.append(rows)
        return QueuedSave(objs, self.dev.record(self.save_stream), sums, None, keep)

    def finish_saves(self, qs: list[QueuedSave]) -> list[np.ndarray]:
        """``finish_save`` for a step's layers at once (one numpy pass per shared plan)."""
        for q in qs:
            if q.done is not None:
                q.done.synchronize()
        got = self._sums_many(qs)
        return [got[id(q)] for q in qs]

    def finish_save(self, q: QueuedSave) -> list[int]:
        """Wait for a queued save; returns each object's folded word checksum."""
        if q.done is not None:
            q.done.synchronize()
        return _folded(q.sums, q.copy, len(q.objs.offsets))


def _runs(offs: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int, int]]:
    """(first index, count, pitch) of runs of parts of one size at one distance apart,
    in order: each run is one 2D copy. Greedy over the blocks of equal consecutive
    distances (found with numpy), so the loop runs once per run, not once per part."""
    n = len(offs)
    if n < 2:
        return [(0, n, int(sizes[0]))] if n else []
    step = np.diff(offs)
    ok = (sizes[1:] == sizes[:-1]) & (step >= -(-sizes[:-1] // WORD) * WORD)  # same size, no overlap
    change = np.ones(n - 1, dtype=bool)
    change[1:] = (step[1:] != step[:-1]) | ~ok[1:] | ~ok[:-1]
    edges = np.flatnonzero(change).tolist() + [n - 1]
    out, i = [], 0
    for a, b in zip(edges[:-1], edges[1:]):  # steps a..b-1 are equal (and usable if ok[a])
        if i > a:
            a = i  # offset a is already in the previous run
        if not ok[a] if a < n - 1 else True:
            continue
        if b - a >= 1 and a >= i:
            if a > i:
                out += [(k, 1, int(sizes[k])) for k in range(i, a)]
            out.append((a, b - a + 1, int(step[a])))
            i = b + 1
    out += [(k, 1, int(sizes[k])) for k in range(i, n)]
    return out
