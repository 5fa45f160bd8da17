"""What the worker's batched transfer path (device_path.py) takes and hands back: a
layer's objects of a step, a planned load batch, a queued load or save; and how far
ahead of the forward loads are queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ascend_store.device.int8_path import Int8Plan, Int8Rows
from ascend_store.device.segments import CopyPlanner, RowPlan, StepPages

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
class BatchLoad:
    """A batch as ``batches`` plans it with the step's other batches of its group:
    ``layers`` and their parts; the DMAs into staging as (staging
    offset, width, arena offset, pitch, rows) and the staged bytes; for raw layers the
    step's row plan, where each [layer, object] payload starts in staging (words) and
    where each layer's cache starts, for int8 the step's dequantizing plan and the batch's
    rows (where its objects and caches are); and the zeroed sums
    the kernel adds into (slices of one upload and one tensor per step: a batch costs the
    host its DMAs, a launch and two events)."""

    layers: list[LayerObjects]
    parts: np.ndarray  # [layer, object] arena offsets
    sizes: np.ndarray  # [layer, object] part sizes
    plan: RowPlan | None = None
    int8: Int8Plan | None = None  # an int8 batch's plan
    rows: Int8Rows | None = None
    runs: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    staged: int = 0
    starts: np.ndarray | None = None  # [layer, object] where each part starts in staging (CPU: arena)
    slot: list | None = None  # the staging ring's entry, once its DMAs are queued
    staging: torch.Tensor | None = None
    landed: object = None  # event: its DMAs are done
    obj_base: torch.Tensor | np.ndarray | None = None
    layer_base: torch.Tensor | None = None
    sums: torch.Tensor | None = None  # its rows of sums_at, once queued
    sums_at: tuple[torch.Tensor, int] | None = None  # the step's sums tensor, the batch's first row


@dataclass
class QueuedLoad:
    layers: list[LayerObjects]  # the batch
    done: object  # device event (None on CPU, where the copy is done on return)
    sums: torch.Tensor  # [layers, objects, 2]
    sums_at: tuple[torch.Tensor, int]  # where they are in the step's sums (BatchLoad.sums_at)


@dataclass
class QueuedSave:
    objs: LayerObjects
    done: object  # device event
    sums: torch.Tensor  # per object: [objects, 2]
    staging: object = None  # device buffers kept alive until the copy is done
