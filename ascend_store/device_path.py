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
  copy is done (at the end of the step), and a mismatch becomes a failed load. Staging
  memory is allocated on the load stream and freed as soon as a copy is queued: the
  caching allocator hands it to the next layer, whose copy runs after on that stream.
- save: the copy of a layer starts from an event recorded on the compute stream right
  after the layer wrote its KV; the headers (with the sums the copy accumulated) are
  written when the copy is done, before the objects are committed.

Layers stored with the int8 codec take the same DMAs, but their pages are quantized or
dequantized by whole-layer tensor ops (``codecs.quantize``/``dequantize``) instead of the
copy kernel, and their word sums are computed per object.

vLLM-free, so ``benchmarks/layerwise.py`` drives exactly this code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ascend_store.codecs import dequantize, quantize
from ascend_store.device import Device
from ascend_store.segments import (
    WORD,
    LayerCopy,
    fold_sums,
    object_sums,
    page_plan,
    plan_objects,
    run_copy,
    storage_words,
    word_sums,
)
from ascend_store.transfer import HEADER_BYTES, LayerLayout


@dataclass
class LayerObjects:
    """One layer's objects in a step: arena offsets, sizes, block ids, pages to skip,
    the keys (for headers and errors) and, for loads, the word checksum each header
    carries (-1: none, e.g. a CRC32 already checked on the host)."""

    name: str
    offsets: list[int]
    sizes: list[int]
    blocks: list[list[int]]
    skips: list[int]
    keys: list[str]
    stored: list[int] | None = None


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
    staging: torch.Tensor | None = None  # kept alive until the copy is done


def _folded(sums: torch.Tensor, copy: LayerCopy | None, n: int) -> list[int]:
    """Per-object checksums from a copy's per-segment sums, or from per-object sums."""
    return object_sums(copy, sums.numpy(), n) if copy is not None else fold_sums(sums.numpy())


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
        self.save_stream = self.dev.stream()
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
        """Queue one layer's copy from the arena into the cache on the load stream; the
        forward may use the layer once its stream waits on the returned ``done`` event."""
        with self.dev.use(self.load_stream):
            copy, sums = self._load_layer(arena, objs)
            return QueuedLoad(objs, self.dev.record(self.load_stream), sums, copy)

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

    def _load_layer(self, arena: torch.Tensor, objs: LayerObjects):
        """Queue one layer's copy. On an accelerator the copy engine moves the objects into
        device memory (one DMA per run of adjacent slots), then a kernel scatters their
        pages into the cache and sums them; kernels never wait on the link, so compute
        keeps every SM. On CPU the pages are copied straight from the arena."""
        if objs.name in self.int8:
            return self._load_int8(arena, objs)
        items = list(zip(objs.offsets, objs.blocks, objs.skips))
        if not self.dev.is_accelerator:
            copy = plan_objects(self.plans[objs.name], items, load=True)
            return copy, run_copy(copy, arena.view(torch.int64), self.words[objs.name], self.dev.device)
        staging, staged = self._stage(arena, objs)
        copy = plan_objects(self.plans[objs.name], [(staged[i], b, k) for i, (_, b, k) in enumerate(items)],
                            load=True)
        return copy, run_copy(copy, staging.view(torch.int64), self.words[objs.name], self.dev.device)

    def _stage(self, arena: torch.Tensor, objs: LayerObjects) -> tuple[torch.Tensor, list[int]]:
        """The layer's objects in device memory (one DMA per run of adjacent slots), and
        where each one starts there. On CPU: the arena itself."""
        if not self.dev.is_accelerator:
            return arena, objs.offsets
        spans, staged = _spans(objs.offsets, objs.sizes)
        total = sum(e - s for s, e in spans)
        staging = torch.empty(-(-total // WORD) * WORD, dtype=torch.uint8, device=self.dev.device)
        pos = 0
        for s, e in spans:
            staging[pos:pos + e - s].copy_(arena[s:e], non_blocking=True)
            pos += e - s
        return staging, staged

    def _pages(self, objs: LayerObjects) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(object, page, block) index tensors of every page a layer's objects move."""
        obj, page, block = [], [], []
        for i, (blocks, skip) in enumerate(zip(objs.blocks, objs.skips)):
            obj += [i] * len(blocks)
            page += range(skip, skip + len(blocks))
            block += blocks
        return tuple(torch.tensor(v, dtype=torch.int64).to(self.dev.device, non_blocking=True)
                     for v in (obj, page, block))

    def _load_int8(self, arena: torch.Tensor, objs: LayerObjects):
        """Dequantize a layer's int8 objects into the cache with whole-layer tensor ops;
        the payloads' word sums come back per object."""
        codec, layout = self.int8[objs.name], self.layouts[objs.name]
        src, starts = self._stage(arena, objs)
        n_bytes = objs.sizes[0] - HEADER_BYTES if objs.sizes else 0
        rows = torch.stack([src[s + HEADER_BYTES:s + HEADER_BYTES + n_bytes] for s in starts]) if starts \
            else torch.empty((0, 8), dtype=torch.uint8, device=self.dev.device)
        if starts:
            n = n_bytes // codec.payload_bytes(layout, 1)
            q, ks, vs = codec.split_rows(layout, rows, n)
            obj, page, block = self._pages(objs)
            view = self.blocks_view[objs.name]
            view[block] = dequantize(q[obj, page], ks[obj, page], vs[obj, page]).to(view.dtype)
        return None, self._to_host(word_sums(rows))

    def _to_host(self, sums: torch.Tensor) -> torch.Tensor:
        if not self.dev.is_accelerator:
            return sums
        host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
        host.copy_(sums, non_blocking=True)
        return host

    # -- saves --------------------------------------------------------------------
    def save_layer(self, arena: torch.Tensor, objs: LayerObjects, after) -> QueuedSave:
        """Queue the copy of one layer's objects into their arena slots once ``after``
        (an event on the compute stream) has passed. On an accelerator a kernel gathers
        the pages into device memory (summing them) and the copy engine moves each
        payload into its slot."""
        items = list(zip(objs.offsets, objs.blocks, objs.skips))
        with self.dev.use(self.save_stream):
            self.dev.wait(after, self.save_stream)
            if objs.name in self.int8:
                return self._save_int8(arena, objs)
            if not self.dev.is_accelerator:
                copy = plan_objects(self.plans[objs.name], items, load=False)
                sums = run_copy(copy, self.words[objs.name], arena.view(torch.int64), self.dev.device)
                return QueuedSave(objs, None, sums, copy)
            payloads = [size - HEADER_BYTES for size in objs.sizes]
            starts = np.concatenate([[0], np.cumsum(payloads)[:-1]]).astype(np.int64).tolist()
            staging = torch.empty(-(-sum(payloads) // WORD) * WORD, dtype=torch.uint8, device=self.dev.device)
            copy = plan_objects(self.plans[objs.name], [(p, b, k) for p, (_, b, k) in zip(starts, items)],
                                load=False, header=0)
            sums = run_copy(copy, self.words[objs.name], staging.view(torch.int64), self.dev.device)
            for off, start, n in zip(objs.offsets, starts, payloads):
                off += HEADER_BYTES
                arena[off:off + n].copy_(staging[start:start + n], non_blocking=True)
            done = self.dev.record(self.save_stream)
        return QueuedSave(objs, done, sums, copy, staging)

    def _save_int8(self, arena: torch.Tensor, objs: LayerObjects) -> QueuedSave:
        """Quantize a layer's blocks with whole-layer tensor ops into payload rows, sum
        them, and move each row into its object's slot."""
        codec, layout = self.int8[objs.name], self.layouts[objs.name]
        n = len(objs.blocks[0])  # saves are whole chunks
        _, _, block = self._pages(objs)
        rows = torch.empty((len(objs.offsets), codec.payload_bytes(layout, n)), dtype=torch.uint8,
                           device=self.dev.device)
        for dst, src in zip(codec.split_rows(layout, rows, n), quantize(self.blocks_view[objs.name][block])):
            dst.copy_(src.view(dst.shape))
        sums = self._to_host(word_sums(rows))
        for off, row in zip(objs.offsets, rows):
            arena[off + HEADER_BYTES:off + HEADER_BYTES + row.numel()].copy_(row, non_blocking=True)
        return QueuedSave(objs, self.dev.record(self.save_stream), sums, None, rows)

    def finish_save(self, q: QueuedSave) -> list[int]:
        """Wait for a queued save; returns each object's folded word checksum."""
        if q.done is not None:
            q.done.synchronize()
        return _folded(q.sums, q.copy, len(q.objs.offsets))


def _spans(offsets: list[int], sizes: list[int], gap: int = 4096) -> tuple[list[tuple[int, int]], list[int]]:
    """Runs of nearly adjacent objects (gaps up to ``gap`` bytes are read along), and
    where each object lands in the concatenation of the runs."""
    if not offsets:
        return [], []
    offs = np.asarray(offsets, dtype=np.int64)
    ends = offs + np.asarray(sizes, dtype=np.int64)
    order = np.argsort(offs, kind="stable")
    o, e = offs[order], ends[order]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(o), dtype=bool)
    new[1:] = o[1:] > reach[:-1] + gap
    first = np.flatnonzero(new)
    starts, stops = o[first], np.maximum.reduceat(e, first)
    base = np.cumsum(stops - starts) - (stops - starts)
    run = np.cumsum(new) - 1
    staged = np.empty(len(o), dtype=np.int64)
    staged[order] = base[run] + o - starts[run]
    return list(zip(starts.tolist(), stops.tolist())), staged.tolist()
