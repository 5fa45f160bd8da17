"""int8 layers on the batched path: a step's plan, shared by the group's layers, and the
load of a batch of layers and the save of one layer with no Python loop over objects.

An int8 object of n blocks holds, after its header: values [n, 2, T, H, D] int8, key
scales [n, H, D] fp16 (per channel over a block's tokens), value scales [n, T, H] fp16
(per token and head) (codecs.Int8Codec). A load stages a batch of layers in device memory
with the raw path's DMAs (half the bytes), then one kernel (kernels.int8_load) dequantizes
the moved pages of every layer of the batch into its cache and sums every payload word of
every object: the host's cost per batch (its DMAs, a launch, two events) is paid once for
several layers, as on the raw path. On CPU the same plan runs as a few vectorized torch
ops per layer. A save quantizes each size class of objects (a prompt's shorter tail
object is its own class) with whole-class tensor ops and moves the payloads into their
slots with the raw path's 2D copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ascend_store.common.codecs import dequantize, quantize
from ascend_store.common.transfer import HEADER_BYTES
from ascend_store.device import kernels
from ascend_store.device.segments import WORD, StepPages, to_device, to_device_rows

SEG_WORDS = 1024  # words summed per kernel program


@dataclass
class Int8Plan:
    """Which pages move where, and the stretches of payload words each program sums, for
    one layer shape and one step: every layer of a batch reads it (where each layer's
    objects sit in staging and where its cache starts come with the batch, ``Int8Rows``)."""

    page_obj: np.ndarray  # per moved page: object index
    page_idx: np.ndarray  # its page within the object's payload
    page_block: np.ndarray  # its cache block
    obj_n: np.ndarray  # per object: blocks in its payload
    seg_obj: np.ndarray  # per summed stretch: object
    seg_word: np.ndarray  # its first word within the payload
    block_words: int  # payload words per block
    t: int  # tokens per block
    tt: int  # token rows per dequantizing program
    segw: int = SEG_WORDS
    tensors: tuple = ()  # the arrays above, on the device (once per plan)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The kernel's index arrays, in its argument order."""
        return (self.page_obj, self.page_idx, self.page_block, self.obj_n, self.seg_obj, self.seg_word)

    @property
    def pages(self) -> int:
        return len(self.page_obj)

    @property
    def segments(self) -> int:
        return len(self.seg_obj)

    @property
    def tcs(self) -> int:
        return -(-self.t // self.tt)


def int8_plan(pages: StepPages, n: np.ndarray, block_bytes: int, t: int) -> Int8Plan:
    moved = pages.block >= 0
    n = np.asarray(n, dtype=np.int64)
    block_words = block_bytes // WORD
    per_obj = -(-(n * block_words) // SEG_WORDS)
    seg_obj = np.repeat(np.arange(len(n), dtype=np.int64), per_obj)
    first = np.repeat(np.cumsum(per_obj) - per_obj, per_obj)
    seg_word = (np.arange(len(seg_obj), dtype=np.int64) - first) * SEG_WORDS
    return Int8Plan(pages.obj[moved], pages.page[moved], pages.block[moved], n, seg_obj, seg_word,
                    block_words, t, min(t, 16))


@dataclass
class Int8Rows:
    """A batch's layers: where each [layer, object] payload starts in staging and where
    each layer's cache starts, as elements from the batch's lowest cache (``dst``: the
    kernel's one base pointer; addresses are flat on the device, and the layers of a batch
    share a dtype and strides)."""

    views: list[torch.Tensor]  # each layer's cache as [blocks, 2, T, H, D]
    obj_base: np.ndarray  # [layers, objects] payload starts in staging (bytes)
    layer_off: np.ndarray  # [layers] elements from dst to each layer's cache
    tensors: tuple = ()  # obj_base and layer_off on the device

    @property
    def objects(self) -> int:
        return self.obj_base.shape[1]

    @property
    def dst(self) -> torch.Tensor:
        return self.views[int(np.argmin(self.layer_off))]


def int8_rows(views: list[torch.Tensor], starts: np.ndarray) -> Int8Rows:
    """The rows of a batch whose [layer, object] parts start at ``starts`` in staging."""
    ptrs = np.array([v.data_ptr() for v in views], dtype=np.int64)
    low = int(np.argmin(ptrs))
    base = np.asarray(starts, dtype=np.int64).reshape(len(views), -1) + HEADER_BYTES
    return Int8Rows(views, base, (ptrs - ptrs[low]) // views[low].element_size())


def load_layers(staging: torch.Tensor, plan: Int8Plan, rows: Int8Rows, sums: torch.Tensor) -> None:
    """Dequantize ``plan``'s pages of every layer of ``rows`` from ``staging`` into its
    cache and add each [layer, object] payload's word sums into ``sums`` ([layers,
    objects, 2], zeroed; valid once the queued work is done)."""
    if staging.device.type == "cuda":
        upload(plan, rows, staging.device)
        kernels.int8_load(staging, plan, rows, sums)
        return
    for r, view in enumerate(rows.views):
        _load_torch(staging, view, plan, rows.obj_base[r], sums[r])


def upload(plan: Int8Plan, rows: Int8Rows, device: torch.device) -> None:
    """The index arrays the kernel reads on the device, in one copy: the plan's once per
    plan, the rows' once per batch."""
    arrays = ([] if plan.tensors else list(plan.arrays())) + (
        [] if rows.tensors else [rows.obj_base.reshape(-1), rows.layer_off])
    if not arrays:
        return
    got = to_device_rows(arrays, device)
    if not plan.tensors:
        plan.tensors, got = tuple(got[:len(plan.arrays())]), got[len(plan.arrays()):]
    if not rows.tensors:
        rows.tensors = tuple(got)


def _load_torch(staging: torch.Tensor, view: torch.Tensor, plan: Int8Plan, obj_start: np.ndarray,
                sums: torch.Tensor) -> None:
    """The kernel's twin for one layer in torch ops (CPU): gathers by index arrays, no loop
    over objects. ``obj_start``: each object's payload start in ``staging`` (bytes)."""
    t, h, d = view.shape[2:]
    vals = 2 * t * h * d
    base = obj_start[plan.page_obj]
    n = plan.obj_n[plan.page_obj]
    q = _gather(staging.view(torch.int8), base + plan.page_idx * vals, vals).view(-1, 2, t, h, d)
    halves = staging.view(torch.float16)
    scales = (base + n * vals) // 2
    ks = _gather(halves, scales + plan.page_idx * h * d, h * d).view(-1, h, d)
    vs = _gather(halves, scales + n * h * d + plan.page_idx * t * h, t * h).view(-1, t, h)
    if plan.pages:
        view[torch.from_numpy(plan.page_block)] = dequantize(q, ks, vs).to(view.dtype)
    words = staging.view(torch.int64)
    total = plan.obj_n * plan.block_words
    obj = np.repeat(np.arange(len(total), dtype=np.int64), total)
    j = np.arange(len(obj), dtype=np.int64) - np.repeat(np.cumsum(total) - total, total)
    w = words[torch.from_numpy(obj_start[obj] // WORD + j)]
    idx = torch.from_numpy(obj)
    sums[:, 0].index_add_(0, idx, w)
    sums[:, 1].index_add_(0, idx, w * torch.from_numpy(j + 1))


def _gather(flat: torch.Tensor, starts: np.ndarray, length: int) -> torch.Tensor:
    """Rows of ``length`` elements of ``flat`` starting at ``starts`` (element offsets)."""
    index = torch.from_numpy(starts[:, None] + np.arange(length, dtype=np.int64)[None, :])
    return flat[index.reshape(-1)].view(len(starts), length)


def quantize_classes(blocks: torch.Tensor, sizes: np.ndarray, pages: StepPages, codec, layout):
    """Per size class of a step's objects: (object indexes, payload rows [m, bytes] on
    the blocks' device, their word sums). Saves are whole objects, so a class's pages are
    its objects' blocks in order."""
    per_block = codec.payload_bytes(layout, 1)
    row = np.full(len(sizes), -1, dtype=np.int64)
    for size in np.unique(sizes).tolist():
        idx = np.flatnonzero(sizes == size)
        n = (size - HEADER_BYTES) // per_block
        row[:] = -1
        row[idx] = np.arange(len(idx))
        take = row[pages.obj] >= 0
        order = np.argsort(row[pages.obj][take] * n + pages.page[take], kind="stable")
        block = to_device(pages.block[take][order], blocks.device)
        rows = torch.empty((len(idx), codec.payload_bytes(layout, n)), dtype=torch.uint8,
                           device=blocks.device)
        for dst, src in zip(codec.split_rows(layout, rows, n), quantize(blocks[block])):  # pages object-major
            dst.copy_(src.view(dst.shape))
        yield idx, rows, word_sums(rows)


def word_sums(rows: torch.Tensor) -> torch.Tensor:
    """(s1, s2) of checksum.py's word checksum for each payload row [N, bytes] (bytes % 8 ==
    0), on the rows' device; int64 arithmetic wraps like the uint64 sums it stands for."""
    w = rows.view(torch.int64)
    i = torch.arange(1, w.shape[1] + 1, dtype=torch.int64, device=w.device)
    return torch.stack([w.sum(1), (w * i).sum(1)], dim=1)
