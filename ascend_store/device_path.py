"""The worker's transfer path on an accelerator (CUDA; NPU through device.py).

The pool's arena is registered as pinned host memory, and each layer moves in one
batched copy (segments.py: a Triton kernel reading or writing the arena directly) on a
side stream, so the compute stream never waits on the host:

- load: layer i+1's copy is queued before layer i is checked, so the link stays busy;
  ``ready(layer, event)`` hands each layer's event to the worker, whose
  ``wait_for_layer_load`` makes the compute stream wait on it. With checksums on, a
  layer is handed over once its copy is done and its objects' sums match the headers.
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
from ascend_store.segments import LayerCopy, object_sums, page_plan, plan_objects, run_copy, storage_words
from ascend_store.transfer import FLAG_WSUM, LayerLayout


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


class DevicePath:
    def __init__(self, device: torch.device, layouts: dict[str, LayerLayout]):
        self.dev = Device(device)
        self.layouts = layouts
        self.plans = {name: page_plan(layout) for name, layout in layouts.items()}
        words = {}
        for layout in layouts.values():  # layers often share one buffer: one view of it
            storage = layout.tensor.untyped_storage()
            if storage.data_ptr() not in words:
                words[storage.data_ptr()] = storage_words(layout.tensor)
        self.words = {name: words[lay.tensor.untyped_storage().data_ptr()] for name, lay in layouts.items()}
        self.load_stream = self.dev.stream()
        self.save_stream = self.dev.stream()
        self._arena: tuple[object, object, torch.Tensor] | None = None  # (epoch, view, words)

    # -- the arena ----------------------------------------------------------------
    def arena(self, epoch, view) -> torch.Tensor:
        """The arena as int64 words the kernel can address, pinned once per pool epoch."""
        if self._arena is None or self._arena[0] != epoch:
            if self._arena is not None:
                self.dev.unpin(self._arena[1])
            self.dev.pin(view)
            host = torch.frombuffer(view, dtype=torch.uint8)
            self._arena = (epoch, view, host)
        return self._arena[2]

    def _arena_src(self, arena: torch.Tensor):
        from ascend_store.kernels import HostPtr

        if self.dev.type == "cuda":
            return HostPtr(arena.data_ptr())
        return arena.view(torch.int64)

    def close(self) -> None:
        if self._arena is not None:
            self.dev.unpin(self._arena[1])
            self._arena = None

    # -- loads --------------------------------------------------------------------
    def load_layers(self, arena: torch.Tensor, layers: list[LayerObjects], verify: bool,
                    ready: Callable[[str, object, list[int]], None],
                    cancelled: Callable[[], bool] = lambda: False) -> None:
        """Copy every layer's objects into the cache, in order. ``ready(name, event,
        bad)`` is called per layer with the event its copy completes on and the indexes
        of objects whose checksum did not match (their pages must not be used)."""
        src = self._arena_src(arena)
        queued: deque = deque()
        for objs in layers:
            if cancelled():
                break
            copy = plan_objects(self.plans[objs.name],
                                list(zip(objs.offsets, objs.blocks, objs.skips)), load=True)
            with self.dev.use(self.load_stream):
                sums = run_copy(copy, src, self.words[objs.name], self.dev.device, self.load_stream)
                event = self.dev.record(self.load_stream)
            if not verify:
                ready(objs.name, event, [])
                continue
            queued.append((objs, event, sums, copy))
            if len(queued) > 1:  # check the previous layer while this one copies
                self._check(arena, *queued.popleft(), ready)
        while queued:
            self._check(arena, *queued.popleft(), ready)

    def _check(self, arena, objs: LayerObjects, event, sums, copy, ready) -> None:
        if event is not None:
            event.synchronize()
        got = np.asarray(object_sums(copy, sums.cpu().numpy(), len(objs.offsets)))
        bad = np.flatnonzero(stored_sums(arena, objs.offsets) != got).tolist()
        ready(objs.name, event, bad)

    # -- saves --------------------------------------------------------------------
    def save_layer(self, arena: torch.Tensor, objs: LayerObjects, after) -> QueuedSave:
        """Queue the copy of one layer's objects into their arena slots once ``after``
        (an event on the compute stream) has passed."""
        copy = plan_objects(self.plans[objs.name], list(zip(objs.offsets, objs.blocks, objs.skips)),
                            load=False)
        with self.dev.use(self.save_stream):
            self.dev.wait(after, self.save_stream)
            sums = run_copy(copy, self.words[objs.name], self._arena_src(arena), self.dev.device,
                            self.save_stream)
            done = self.dev.record(self.save_stream)
        return QueuedSave(objs, done, sums, copy)

    def finish_save(self, q: QueuedSave) -> list[int]:
        """Wait for a queued save; returns each object's folded word checksum."""
        if q.done is not None:
            q.done.synchronize()
        return object_sums(q.copy, q.sums.cpu().numpy(), len(q.objs.offsets))


def stored_sums(arena: torch.Tensor, offsets: list[int]) -> np.ndarray:
    """The word checksum each object's header carries (-1 where it carries none)."""
    host = arena.numpy()
    offs = np.asarray(offsets, dtype=np.int64)
    flags = host[offs + 6].astype(np.int64) | (host[offs + 7].astype(np.int64) << 8)
    crc = sum(host[offs + 24 + i].astype(np.int64) << (8 * i) for i in range(4))
    return np.where(flags & FLAG_WSUM, crc, -1)


