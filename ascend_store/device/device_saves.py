"""The save half of the worker's batched transfer path (``DevicePath``, device_path.py):
a layer's pages gathered and summed on the device, then moved into their arena slots by
the copy engine; on CPU (tests) and for int8 layers, torch ops. A mixin: it reads the
path's streams, page plans and cache views, which ``DevicePath.__init__`` sets up.
"""

from __future__ import annotations

import numpy as np
import torch

from ascend_store.common.transfer import HEADER_BYTES
from ascend_store.device import int8_path
from ascend_store.device.device_work import LayerObjects, QueuedSave
from ascend_store.device.segments import WORD, dma_plans, dma_runs, fold_alike, run_copy, to_device


class DeviceSaves:
    def save_layer(self, arena: torch.Tensor, objs: LayerObjects, after) -> QueuedSave:
        """Queue the copy of one layer's objects into their arena slots once ``after``
        (an event on the compute stream) has passed: on an accelerator a kernel gathers
        and sums the pages into device memory, the copy engine moves them to the slots."""
        plan = self.plans.get(objs.name)
        if objs.name in self.int8 or not self.dev.is_accelerator:
            with self.dev.use(self.save_stream):
                self.dev.wait(after, self.save_stream)
                if objs.name in self.int8:
                    return self._save_int8(arena, objs)
                # The page shape's plan from the layer's lowest payload (a negative offset
                # means "no destination" to the copy): a step's layers of chunk objects lie
                # alike, so they share one (built once a step).
                offs = np.asarray(objs.offsets, dtype=np.int64)
                low = int(offs.min()) + HEADER_BYTES if len(offs) else 0
                copy = objs.plan().layer(self.shapes[objs.name], offs + (HEADER_BYTES - low), load=False)
                src = self.words[objs.name][plan.origin // WORD:]
                sums = run_copy(copy, src, arena.view(torch.int64)[low // WORD:], self.dev.device)
                return QueuedSave(objs, None, sums)
        # The parts in staging as a load stages them (headers too: they ride along in the 2D
        # copies and are rewritten at the commit); the step's layers share a plan.
        parts = np.asarray(objs.offsets, dtype=np.int64)[None]
        ((runs, nbytes, starts),) = dma_plans([(parts, np.asarray(objs.sizes, dtype=np.int64)[None])],
                                              objs.plan().dmas)
        # The gather runs on its own stream, so a layer's kernel runs while the copy engine
        # still moves the layer before (on one stream each kernel waited for the last DMA).
        with self.dev.use(self.gather_stream):
            self.dev.wait(after, self.gather_stream)
            staging = torch.empty(nbytes, dtype=torch.uint8, device=self.dev.device)
            # The page shape's plan, read from where this layer's cache starts: the step's
            # layers of one shape share it, so its offsets go to the device once a step.
            copy = objs.plan().layer(self.shapes[objs.name], starts[0] + HEADER_BYTES, load=False)
            src = self.words[objs.name][plan.origin // WORD:]
            sums = run_copy(copy, src, staging.view(torch.int64), self.dev.device)
            gathered = self.dev.record(self.gather_stream)
        staging.record_stream(self.save_stream)
        self.dev.wait(gathered, self.save_stream)
        for at, width, dst, pitch, count in runs:
            self.dev.copy_2d(arena, dst, pitch, staging, at, width, width, count, self.save_stream)
        return QueuedSave(objs, self.dev.record(self.save_stream), sums, staging)

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
            sums.index_copy_(0, to_device(idx, self.dev.device), got)  # a pageable copy would block
            width = rows.shape[1]
            flat = rows.view(-1)
            for first, count, pitch in dma_runs(offsets[idx] + HEADER_BYTES, sizes[idx] - HEADER_BYTES):
                at = int(offsets[idx[first]]) + HEADER_BYTES
                self.dev.copy_2d(arena, at, pitch, flat, first * width, width, width, count, self.save_stream)
            keep.append(rows)
        return QueuedSave(objs, self.dev.record(self.save_stream), sums, keep)

    def finish_saves(self, qs: list[QueuedSave]) -> list[np.ndarray]:
        """Wait for a step's queued layer saves; returns each one's objects' folded word
        checksums (one numpy pass per shared plan)."""
        for q in qs:
            if q.done is not None:
                q.done.synchronize()
        with self.dev.use(self.save_stream):  # not behind the compute stream's queued work
            got = fold_alike([q.sums for q in qs])
        return [g[0] for g in got]
