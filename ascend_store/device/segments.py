"""The batched transfer path's plan and checksum: which bytes of a layer's blocks go
where in one batched copy between a paged KV cache and pool objects (device_path.py
moves the objects), with the checksum computed by the copy itself.

A block's page is cut into *segments*: the page's largest contiguous runs (one for a
block-major page, two for FlashAttention's [2, blocks, ...] where K and V are apart).
An object's payload is its pages back to back, each page's segments in order: the same
bytes ``transfer.write_object`` writes with the raw codec, so either path reads what the
other wrote.

The checksum (checksum.py) is accumulated per segment by the copy; per-segment sums
combine into the object's: a segment at word offset o adds s1_seg and t_seg + o * s1_seg.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ascend_store.common.checksum import fold_array
from ascend_store.common.transfer import LayerLayout, storage_view
from ascend_store.device import kernels

WORD = kernels.WORD
ALIGN_WORDS = 2  # 16 bytes: the alignment Triton specializes pointers on


@dataclass(frozen=True)
class PagePlan:
    """Where one page's segments are: ``starts[b]`` is block b's page origin (bytes from
    the storage start), ``offsets`` the segments' byte offsets from that origin."""

    seg_bytes: int
    offsets: tuple[int, ...]
    block_stride: int
    origin: int

    @property
    def page_bytes(self) -> int:
        return self.seg_bytes * len(self.offsets)

    def start(self, block: int) -> int:
        return self.origin + block * self.block_stride


def page_plan(layout: LayerLayout) -> PagePlan:
    t = layout.tensor
    size = t.element_size()
    page = layout.page(0)  # in memory order: a dense page is one segment
    shape, strides = list(page.shape), list(page.stride())
    # Merge the innermost dims while they are contiguous: that run is one segment.
    inner, expect, k = 1, 1, len(shape)
    while k > 0 and (shape[k - 1] == 1 or strides[k - 1] == expect):
        inner *= shape[k - 1]
        expect *= shape[k - 1]
        k -= 1
    # The outer dims enumerate the segments, in the row-major order of page.contiguous().
    plan = PagePlan(inner * size, tuple(o * size for o in _row_major(shape[:k], strides[:k])),
                    t.stride(layout.block_dim) * size, t.storage_offset() * size)
    if any(v % WORD for v in (plan.seg_bytes, plan.block_stride, plan.origin, *plan.offsets)):
        raise ValueError(f"cache layout {tuple(t.shape)}/{t.stride()} is not 8-byte aligned")
    return plan


def _row_major(shape: list[int], strides: list[int]) -> list[int]:
    offsets = [0]
    for n, st in zip(shape, strides):
        offsets = [o + i * st for o in offsets for i in range(n)]
    return offsets


def storage_words(t: torch.Tensor) -> torch.Tensor:
    """An int64 view of all of ``t``'s storage (the copy kernel addresses it in words)."""
    return storage_view(t, torch.int64)


@dataclass
class LayerCopy:
    """One layer's batched copy: segment word offsets and the payload position of each
    segment (for combining the checksums per object)."""

    src: np.ndarray
    dst: np.ndarray
    seg_words: int
    obj_of_seg: np.ndarray  # which object each segment belongs to
    payload_word: np.ndarray  # each segment's word offset within its object's payload
    n_objects: int
    device_segs: object = None  # 4 rows of [segments] on the device, once uploaded (run_copy)


@dataclass
class RowPlan:
    """A step's load plan for every layer of one page shape (``PagePlan`` at origin 0):
    per segment its object, its word offset in that object's payload and in a layer's
    cache (-1: a skipped page). A layer adds where its cache starts, an object where its
    part of that layer starts: the plan is built once per step, whatever the layers."""

    obj_of_seg: np.ndarray
    payload_word: np.ndarray
    cache_word: np.ndarray
    seg_words: int
    device_segs: object = None  # 3 rows of [segments] on the device, once uploaded


@dataclass
class StepPages:
    """Every page a step moves for one KV cache group, in object order: the object
    (index into the step's admitted objects) and page within its payload of each, and
    the cache block it goes to or comes from (-1: a skipped page, read for the checksum
    only). Built once per step; every layer of the group shares it."""

    obj: np.ndarray
    page: np.ndarray
    block: np.ndarray
    n_objects: int

    @classmethod
    def of(cls, blocks: list[list[int]], skips: list[int], totals: list[int] | None = None) -> "StepPages":
        """``totals``: each object's page count, when pages past ``skip + len(blocks)`` are
        not moved (a load that needs only the start of an object still reads the rest for
        its checksum)."""
        ends = [k + len(b) for b, k in zip(blocks, skips)]
        totals = ends if totals is None else totals
        counts = np.asarray(totals, dtype=np.int64)
        flat: list[int] = []
        for b, k, end, total in zip(blocks, skips, ends, totals):
            if k:
                flat += [-1] * k
            flat += b
            if total > end:
                flat += [-1] * (total - end)
        obj = np.repeat(np.arange(len(blocks), dtype=np.int64), counts)
        page = np.arange(len(obj), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        return cls(obj, page, np.asarray(flat, dtype=np.int64), len(blocks))


class CopyPlanner:
    """Builds each layer's ``LayerCopy`` from a step's pages: the cache side depends only
    on the layer's page plan (shared by layers with the same one), the arena side only on
    where each object's part for that layer starts, so a layer costs two numpy adds."""

    def __init__(self, pages: StepPages):
        self.pages = pages
        self._cache: dict[PagePlan, tuple] = {}
        self._copies: dict[tuple, LayerCopy] = {}
        self.dmas: dict[tuple, tuple] = {}  # the step's DMA plans (dma_plans)
        self.payloads: dict[tuple, object] = {}  # the step's payload layouts on the device (DevicePath)

    def _cache_side(self, plan: PagePlan):
        got = self._cache.get(plan)
        if got is None:
            p = self.pages
            per_page = len(plan.offsets)
            seg_words = plan.seg_bytes // WORD
            seg = np.arange(per_page, dtype=np.int64)
            payload = ((p.page[:, None] * per_page + seg[None, :]) * seg_words).reshape(-1)
            seg_off = np.asarray(plan.offsets, dtype=np.int64) // WORD
            cache = (plan.origin + p.block * plan.block_stride)[:, None] // WORD + seg_off[None, :]
            cache = np.where(p.block[:, None] >= 0, cache, -1).reshape(-1)
            got = self._cache[plan] = (payload, cache, np.repeat(p.obj, per_page), seg_words)
        return got

    def rows(self, shape: PagePlan) -> RowPlan:
        """The step's ``RowPlan`` for layers whose page plan is ``shape`` moved to origin 0."""
        def build():
            payload, cache, obj_of_seg, seg_words = self._cache_side(shape)
            return RowPlan(obj_of_seg, payload, cache, seg_words)
        return self.cached(("rows", shape), build)

    def cached(self, key: tuple, build):
        """A per-step plan other than a ``LayerCopy`` (int8 layers), built once per key."""
        got = self._copies.get(key)
        if got is None:
            got = self._copies[key] = build()
        return got

    def layer(self, plan: PagePlan, payload_offsets: np.ndarray, load: bool) -> LayerCopy:
        """``payload_offsets``: byte offset of each object's payload for this layer."""
        offs = np.asarray(payload_offsets, dtype=np.int64)
        key = (plan, load, offs.tobytes())
        got = self._copies.get(key)  # staged layers share one (uploaded) copy plan
        if got is None:
            payload, cache, obj_of_seg, seg_words = self._cache_side(plan)
            arena = (offs // WORD)[obj_of_seg] + payload
            src, dst = (arena, cache) if load else (cache, arena)
            got = self._copies[key] = LayerCopy(src, dst, seg_words, obj_of_seg, payload,
                                                self.pages.n_objects)
        return got


def run_copy(copy: LayerCopy, src, dst, device: torch.device) -> torch.Tensor:
    """Queue the copy on the current stream (Triton on CUDA, torch ops elsewhere); returns
    each object's payload word sums [objects, 2] (int64, on the copy's device), valid
    once the queued work is done (read them with ``host_array`` then: the host never
    blocks here). The segment offsets go to the device once per plan: the layers of a
    step share it."""
    sums = torch.zeros((copy.n_objects, 2), dtype=torch.int64, device=device)
    if device.type != "cuda":
        seg_sums = torch.empty((len(copy.src), 2), dtype=torch.int64)  # every row is written
        kernels.copy_segments_sum_torch(src, dst, copy.src, copy.dst, seg_sums, copy.seg_words)
        kernels.add_to_objects(seg_sums, copy.obj_of_seg, copy.payload_word, sums)
        return sums
    if len(copy.src) == 0:
        return sums
    if copy.device_segs is None:
        copy.device_segs = to_device_rows([copy.src, copy.dst, copy.obj_of_seg, copy.payload_word], device)
    kernels.copy_segments_sum(src, dst, copy.device_segs, sums, copy.seg_words)
    return sums


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """int64 ``values`` on the device without blocking the host: through pinned memory (a
    copy from pageable memory may block it), on the current stream. On CPU: the values."""
    if torch.device(device).type == "cpu":
        return torch.from_numpy(np.array(values, dtype=np.int64))
    host = torch.empty(values.shape, dtype=torch.int64, pin_memory=True)
    host.numpy()[...] = values
    return host.to(device, non_blocking=True)


def to_device_rows(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Several int64 arrays on the device in one ``to_device``, each starting on a 16-byte
    boundary. Triton compiles a kernel once per alignment of its pointer arguments: index
    arrays at odd words would make new variants of a kernel appear with the step's sizes,
    each a compile of hundreds of ms on the step's thread the first time a machine sees it."""
    lens = [len(a) for a in arrays]
    starts = np.cumsum([0] + [-(-n // ALIGN_WORDS) * ALIGN_WORDS for n in lens]).tolist()
    flat = np.zeros(starts[-1], dtype=np.int64)
    for a, at, n in zip(arrays, starts, lens):
        flat[at:at + n] = a
    dev = to_device(flat, device)
    return [dev[at:at + n] for at, n in zip(starts, lens)]


def host_array(t: torch.Tensor) -> np.ndarray:
    """A finished copy's sums (or any tensor) as a numpy array in host memory."""
    return t.numpy() if t.device.type == "cpu" else t.cpu().numpy()


def stage_layout(parts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, ...]:
    """Where a load batch's parts ([layer, object] arena offsets and sizes) go in device
    staging: when every object holds the batch's layers back to back (chunk objects do),
    one span per object covers them all, else one span per part. Returns the spans'
    arena offsets and widths ([span row, object]), their staging offsets (back to back,
    each padded to whole words) and each part's staging offset ([layer, object])."""
    if len(parts) > 1 and np.array_equal(parts[1:], parts[:-1] + sizes[:-1]):
        spans, widths = parts[:1], parts[-1:] + sizes[-1:] - parts[:1]
        of_row = np.zeros(len(parts), dtype=np.int64)
    else:
        spans, widths, of_row = parts, sizes, np.arange(len(parts))
    slot = (-(-widths // WORD) * WORD).reshape(-1)
    staged = (np.cumsum(slot) - slot).reshape(widths.shape)
    return spans, widths, staged, staged[of_row] + (parts - spans[of_row])


def fold_alike(sums: list[torch.Tensor]) -> list[np.ndarray]:
    """Folded checksums of several copies' objects, [layers, objects] per copy, from their
    payload word sums ([objects, 2], or [layers, objects, 2] for a load batch). Copies of
    one object count come back to the host in one copy and fold in one numpy pass."""
    alike: dict[int, list[int]] = {}
    for i, t in enumerate(sums):
        alike.setdefault(t.shape[-2], []).append(i)
    out: list[np.ndarray] = [np.zeros((0, 0), dtype=np.int64)] * len(sums)
    for n, members in alike.items():
        rows = [sums[i].reshape(-1, n, 2) for i in members]
        u = host_array(torch.cat(rows)).astype(np.int64).view(np.uint64)
        got = fold_array(u[..., 0], u[..., 1])
        at = 0
        for i, r in zip(members, rows):
            out[i] = got[at:at + len(r)]
            at += len(r)
    return out


def dma_runs(offs: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int, int]]:
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


def dma_plan(parts: np.ndarray, sizes: np.ndarray) -> tuple[list, int, np.ndarray]:
    """Where a batch's parts ([layer, object] arena offsets and sizes) go in device
    staging (``stage_layout``): one 2D DMA per run of equally spaced spans,
    as (staging offset, width, arena offset, pitch, rows); the staged bytes; and each
    part's staging offset."""
    spans, widths, staged, starts = stage_layout(parts, sizes)
    slot = -(-widths // WORD) * WORD
    runs = [(int(staged[g, first]), int(slot[g, first]), int(spans[g, first]), pitch, count)
            for g in range(len(spans)) for first, count, pitch in dma_runs(spans[g], widths[g])]
    return runs, int(slot.sum()), starts


def dma_plans(batches: list[tuple[np.ndarray, np.ndarray]],
              memo: dict | None = None) -> list[tuple[list, int, np.ndarray]]:
    """``dma_plan`` of each (parts, sizes). Batches laid out alike (the same sizes, and
    parts at the same distances from their first: a step's layers of chunk objects) share
    one plan, its arena offsets shifted: a 32K hit's 28 one-layer batches plan once.
    ``memo`` keeps the plans across calls (a step's planner holds it: ``CopyPlanner.dmas``)."""
    memo = {} if memo is None else memo
    out = []
    for parts, sizes in batches:
        origin = int(parts.flat[0]) if parts.size else 0
        key = (parts.shape, (parts - origin).tobytes(), sizes.tobytes())
        if key not in memo:
            memo[key] = (origin, dma_plan(parts, sizes))
        base, (runs, staged, starts) = memo[key]
        d = origin - base
        out.append(([(at, w, src + d, pitch, n) for at, w, src, pitch, n in runs], staged, starts))
    return out

