"""The worker's batched transfer path (CUDA; NPU through device.py; CPU for tests).

The pool's arena is registered as pinned host memory. Each layer moves on a side stream
in two parts: the copy engine moves whole objects between the arena and device memory
(one DMA per run of adjacent slots), and one kernel (segments.py) scatters or gathers
their pages to or from the paged cache, summing every word on the way. The kernel only
touches device memory, so it takes the SMs for microseconds; a kernel reading the arena
over the link directly would hold SMs for the whole transfer and slow the forward it is
meant to hide behind (measured: docs/benchmarks.md). The compute stream never waits on
the host:

- load: ``ready(layer, event)`` hands each layer's event to the worker as soon as its
  copy is queued; ``wait_for_layer_load`` makes the compute stream wait on it. The sums
  are compared on the host behind the forward, and a mismatch becomes a failed load.
  Up to ``window`` layers are in flight, so host hiccups leave no gap on the link.
- save: the copy of a layer starts from an event recorded on the compute stream right
  after the layer wrote its KV; the headers (with the sums the copy accumulated) are
  written when the copy is done, before the objects are committed.

vLLM-free, so ``benchmarks/layerwise.py`` drives exactly this code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ascend_store.device import Device
from ascend_store.segments import (
    WORD,
    LayerCopy,
    object_sums,
    page_plan,
    plan_objects,
    run_copy,
    storage_words,
)
from ascend_store.transfer import CRC_AT, FLAG_WSUM, FLAGS_AT, HEADER_BYTES, LayerLayout


@dataclass
class LayerObjects:
    """One layer's objects in a step: arena offsets, sizes, block ids, pages to skip,
    and the keys (for headers and errors)."""

    name: str
    offsets: list[int]
    sizes: list[int]
    blocks: list[list[int]]
    skips: list[int]
    keys: list[str]


@dataclass
class QueuedSave:
    objs: LayerObjects
    done: object  # device event
    sums: torch.Tensor
    copy: LayerCopy
    staging: torch.Tensor | None = None  # kept alive until the copy is done


class DevicePath:
    def __init__(self, device: torch.device, layouts: dict[str, LayerLayout], window: int = 4):
        self.dev = Device(device)
        # Layers a load may have in flight: enough slack that a slow host (the GIL, a
        # busy forward thread) leaves no gap on the link, few enough to bound staging.
        self.window = window
        self.plans = {name: page_plan(layout) for name, layout in layouts.items()}
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
    def load_layers(self, arena: torch.Tensor, layers, verify: bool,
                    ready: Callable[[str, object], None], failed: Callable[[str, list[int]], None],
                    cancelled: Callable[[], bool] = lambda: False) -> None:
        """Copy every layer's objects (an iterable of LayerObjects, built lazily so a
        layer's host-side checks run just before its copy) into the cache, in order.

        ``ready(name, event)`` follows each layer's enqueue: the forward may go on as soon
        as its stream waits on ``event``, nothing waits on the host. The checksums are
        compared afterwards, a layer's while later ones copy (up to ``window`` queued), and
        ``failed(name, indexes)`` names objects that did not match: their blocks must be
        reported as failed loads (vLLM then recomputes them and drops the step's output
        for their requests), so a bad object costs a recompute, never a wrong token."""
        queued: deque = deque()
        for objs in layers:
            if cancelled():
                break
            if len(queued) >= self.window:  # bounds the staging memory in flight
                self._check(arena, *queued.popleft(), failed, verify)
            with self.dev.use(self.load_stream):
                copy, sums, keep = self._load_layer(arena, objs)
                event = self.dev.record(self.load_stream)
            ready(objs.name, event)
            queued.append((objs, event, sums, copy, keep))
        while queued:
            self._check(arena, *queued.popleft(), failed, verify)

    def _load_layer(self, arena: torch.Tensor, objs: LayerObjects):
        """Queue one layer's copy. On an accelerator the copy engine moves the objects into
        device memory (one DMA per run of adjacent slots), then a kernel scatters their
        pages into the cache and sums them; kernels never wait on the link, so compute
        keeps every SM. On CPU the pages are copied straight from the arena."""
        items = list(zip(objs.offsets, objs.blocks, objs.skips))
        if not self.dev.is_accelerator:
            copy = plan_objects(self.plans[objs.name], items, load=True)
            return copy, run_copy(copy, arena.view(torch.int64), self.words[objs.name], self.dev.device), None
        spans, staged = _spans(objs.offsets, objs.sizes)
        total = sum(e - s for s, e in spans)
        staging = torch.empty(-(-total // WORD) * WORD, dtype=torch.uint8, device=self.dev.device)
        pos = 0
        for s, e in spans:
            staging[pos:pos + e - s].copy_(arena[s:e], non_blocking=True)
            pos += e - s
        copy = plan_objects(self.plans[objs.name], [(staged[i], b, k) for i, (_, b, k) in enumerate(items)],
                            load=True)
        sums = run_copy(copy, staging.view(torch.int64), self.words[objs.name], self.dev.device)
        return copy, sums, staging

    def _check(self, arena, objs: LayerObjects, event, sums, copy, keep, failed, verify: bool) -> None:
        if event is not None:
            event.synchronize()
        if not verify:
            return
        got = np.asarray(object_sums(copy, sums.numpy(), len(objs.offsets)))
        stored = stored_sums(arena, objs.offsets)  # objects with a CRC32 were checked on the host
        bad = np.flatnonzero((stored >= 0) & (stored != got)).tolist()
        if bad:
            failed(objs.name, bad)

    # -- saves --------------------------------------------------------------------
    def save_layer(self, arena: torch.Tensor, objs: LayerObjects, after) -> QueuedSave:
        """Queue the copy of one layer's objects into their arena slots once ``after``
        (an event on the compute stream) has passed. On an accelerator a kernel gathers
        the pages into device memory (summing them) and the copy engine moves each
        payload into its slot."""
        items = list(zip(objs.offsets, objs.blocks, objs.skips))
        with self.dev.use(self.save_stream):
            self.dev.wait(after, self.save_stream)
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

    def finish_save(self, q: QueuedSave) -> list[int]:
        """Wait for a queued save; returns each object's folded word checksum."""
        if q.done is not None:
            q.done.synchronize()
        return object_sums(q.copy, q.sums.numpy(), len(q.objs.offsets))


def _spans(offsets: list[int], sizes: list[int], gap: int = 4096) -> tuple[list[tuple[int, int]], list[int]]:
    """Runs of nearly adjacent objects (gaps up to ``gap`` bytes are read along), and
    where each object lands in the concatenation of the runs."""
    order = sorted(range(len(offsets)), key=offsets.__getitem__)
    spans: list[list[int]] = []
    for i in order:
        if spans and offsets[i] <= spans[-1][1] + gap:
            spans[-1][1] = max(spans[-1][1], offsets[i] + sizes[i])
        else:
            spans.append([offsets[i], offsets[i] + sizes[i]])
    staged, base, k = [0] * len(offsets), 0, 0
    for i in order:
        while offsets[i] >= spans[k][1]:
            base += spans[k][1] - spans[k][0]
            k += 1
        staged[i] = base + offsets[i] - spans[k][0]
    return [tuple(s) for s in spans], staged


def stored_sums(arena: torch.Tensor, offsets: list[int]) -> np.ndarray:
    """The word checksum each object's header carries (-1 where it carries none)."""
    host = arena.numpy()
    offs = np.asarray(offsets, dtype=np.int64)
    flags = sum(host[offs + FLAGS_AT + i].astype(np.int64) << (8 * i) for i in range(2))
    crc = sum(host[offs + CRC_AT + i].astype(np.int64) << (8 * i) for i in range(4))
    return np.where(flags & FLAG_WSUM, crc, -1)


