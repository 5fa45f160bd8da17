"""One batched kernel per layer between a paged KV cache and staged pool objects.

A layer's blocks are copied as *segments* (a block's K part and V part in a
FlashAttention layout, or the whole page in a block-major one) of equal size, from
arbitrary source offsets to arbitrary destination offsets, summing every word on the
way (checksum.py). On CUDA one Triton kernel copies every segment of the layer in
device memory (the objects were staged by one DMA per run, device_path.py); elsewhere
the same plan runs as torch copies.

A load moves several layers of one page shape in one launch (``load_rows``): every layer
reads the same segment plan, shifted by where its cache starts and where each object's
part of that layer sits in staging, so the host plans a step once, not once per layer.

int8 layers load with one kernel too (``int8_load``): its programs either dequantize one
page's K or V rows into a layer's cache or sum one stretch of an object's payload words,
so a batch of int8 layers lands in one launch whatever the number of its objects.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton
    triton = None

WORD = 8  # bytes per copied element: offsets and sizes are in 8-byte words


if triton is not None:

    @triton.jit
    def _copy_segments_sum_kernel(src, dst, src_offs, dst_offs, seg_obj, seg_payload, sums, seg_words,
                                  BLOCK: tl.constexpr):
        seg = tl.program_id(0)
        part = tl.program_id(1)
        s = tl.load(src_offs + seg)
        d = tl.load(dst_offs + seg)
        o = tl.load(seg_obj + seg)
        pw = tl.load(seg_payload + seg)
        idx = part * BLOCK + tl.arange(0, BLOCK)
        mask = idx < seg_words
        w = tl.load(src + s + idx, mask=mask, other=0)
        tl.store(dst + d + idx, w, mask=mask & (d >= 0))  # d < 0: read for the checksum only
        tl.atomic_add(sums + 2 * o, tl.sum(w, axis=0))
        tl.atomic_add(sums + 2 * o + 1, tl.sum(w * (pw + idx + 1).to(tl.int64), axis=0))


    # Counts that change with every step are not specialized on (Triton would compile a
    # variant for 1 and for multiples of 16); see segments.to_device_rows for pointers.
    @triton.jit(do_not_specialize=["n_objs"])
    def _load_rows_kernel(src, dst, seg_obj, seg_payload, seg_cache, obj_base, layer_base, sums, n_objs,
                          seg_words, BLOCK: tl.constexpr):
        seg = tl.program_id(0)
        part = tl.program_id(1)
        row = tl.program_id(2)  # a layer of the batch
        o = tl.load(seg_obj + seg)
        pw = tl.load(seg_payload + seg)
        s = tl.load(obj_base + row * n_objs + o) + pw
        c = tl.load(seg_cache + seg)
        d = tl.load(layer_base + row) + c
        idx = part * BLOCK + tl.arange(0, BLOCK)
        mask = idx < seg_words
        w = tl.load(src + s + idx, mask=mask, other=0)
        tl.store(dst + d + idx, w, mask=mask & (c >= 0))  # c < 0: read for the checksum only
        # The object's sums directly (word j of its payload weighs j + 1): the host folds
        # [layers, objects] pairs, not one per segment.
        k = row * n_objs + o
        tl.atomic_add(sums + 2 * k, tl.sum(w, axis=0))
        tl.atomic_add(sums + 2 * k + 1, tl.sum(w * (pw + idx + 1).to(tl.int64), axis=0))


    @triton.jit(do_not_specialize=["n_dequant", "n_objs"])
    def _int8_load_kernel(words, bytes_, halves, dst, page_obj, page_idx, page_block, obj_n, seg_obj,
                          seg_word, obj_base, layer_off, sums, n_dequant, n_objs, block_words,
                          sb, skv, st, sh, sd, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
                          TT: tl.constexpr, BHD: tl.constexpr, SEGW: tl.constexpr):
        pid = tl.program_id(0)
        layer = tl.program_id(1)  # a layer of the batch
        if pid < n_dequant:  # one page's K (kv 0) or V (kv 1) rows [tc*TT, tc*TT + TT)
            tcs = (T + TT - 1) // TT
            p = pid // (2 * tcs)
            kv = (pid // tcs) % 2
            tc = pid % tcs
            o = tl.load(page_obj + p)
            pg = tl.load(page_idx + p)
            blk = tl.load(page_block + p)
            base = tl.load(obj_base + layer * n_objs + o)  # payload start, bytes (a multiple of 8)
            n = tl.load(obj_n + o)
            t = tc * TT + tl.arange(0, TT)
            hd = tl.arange(0, BHD)
            m = (t[:, None] < T) & (hd[None, :] < H * D)
            row = ((pg * 2 + kv) * T + t[:, None]) * (H * D)
            q = tl.load(bytes_ + base + row + hd[None, :], mask=m, other=0)
            # fp16 elements: key scales [n, H, D], then value scales [n, T, H]
            scales = (base + n * 2 * T * H * D) // 2
            # K: one scale per channel, for every row; V: one per token and head. Both are
            # read (a few hundred bytes) and one is kept: no branch, no mixed masks.
            ks = tl.load(halves + scales + pg * H * D + hd, mask=hd < H * D, other=0).to(tl.float32)
            vs = tl.load(halves + scales + n * H * D + pg * T * H + t[:, None] * H + hd[None, :] // D,
                         mask=m, other=0).to(tl.float32)
            is_k = (kv == 0).to(tl.float32)
            sc = ks[None, :] * is_k + vs * (1.0 - is_k)
            x = q.to(tl.float32) * sc
            out = dst + tl.load(layer_off + layer) + blk * sb + kv * skv + t[:, None] * st
            out += (hd[None, :] // D) * sh + (hd[None, :] % D) * sd
            tl.store(out, x.to(dst.dtype.element_ty), mask=m)
        else:  # the word sums of one stretch of an object's payload (moved pages or not)
            s = pid - n_dequant
            o = tl.load(seg_obj + s)
            k = layer * n_objs + o
            w0 = tl.load(seg_word + s)
            total = tl.load(obj_n + o) * block_words
            idx = w0 + tl.arange(0, SEGW)
            w = tl.load(words + tl.load(obj_base + k) // 8 + idx, mask=idx < total, other=0)
            tl.atomic_add(sums + 2 * k, tl.sum(w, axis=0))
            tl.atomic_add(sums + 2 * k + 1, tl.sum(w * (idx + 1).to(tl.int64), axis=0))


def copy_segments_sum(src, dst, segs: list[torch.Tensor], sums: torch.Tensor, seg_words: int,
                      block: int = 1024, num_warps: int = 4) -> None:
    """Copy segments of ``seg_words`` 8-byte words (int64 tensors) and add each object's
    payload word sums into ``sums`` [objects, 2] (zeroed): (sum of w, sum of (j + 1) * w)
    over the payload's words j, mod 2**64. ``segs``: 4 rows of [segments] on the device,
    each segment's source and destination word offsets, its object and its word offset in
    that object's payload. A negative destination reads the segment for its sums only."""
    n = segs[0].numel()
    if n == 0:
        return
    grid = (n, triton.cdiv(seg_words, block))
    _copy_segments_sum_kernel[grid](src, dst, segs[0], segs[1], segs[2], segs[3], sums, seg_words,
                                    BLOCK=block, num_warps=num_warps)


def load_rows(src: torch.Tensor, dst: torch.Tensor, segs: list[torch.Tensor], obj_base: torch.Tensor,
              layer_base: torch.Tensor, sums: torch.Tensor, seg_words: int, block: int = 1024,
              num_warps: int = 4) -> None:
    """Copy the segments of ``len(layer_base)`` layers from staged objects into their caches
    and add each object's payload word sums into ``sums`` [layers, objects, 2] (zeroed;
    (sum of w, sum of (j + 1) * w) over the payload's words j, mod 2**64). ``segs``: 3 rows of
    [segments], each segment's object, word offset in that object's payload, and word offset in a layer's
    cache (-1: read for the checksum only); ``obj_base`` [layers, objects]: where each
    object's payload of that layer starts in ``src``; ``layer_base`` [layers]: where the
    layer's cache starts, in words from ``dst`` (the layers' caches may be separate
    allocations: addresses are flat on the device, so one base pointer reaches them all)."""
    n, rows = segs[0].numel(), layer_base.numel()
    if n == 0 or rows == 0:
        return
    grid = (n, triton.cdiv(seg_words, block), rows)
    _load_rows_kernel[grid](src, dst, segs[0], segs[1], segs[2], obj_base, layer_base, sums,
                            obj_base.shape[1], seg_words, BLOCK=block, num_warps=num_warps)


def copy_segments_sum_torch(src: torch.Tensor, dst: torch.Tensor, src_offs, dst_offs,
                            sums: torch.Tensor, seg_words: int) -> None:
    """The same with torch ops (int64 arithmetic wraps like the kernel's); offsets are
    sequences or numpy arrays."""
    weights = torch.arange(1, seg_words + 1, dtype=torch.int64, device=src.device)
    for i, (s, d) in enumerate(zip(_ints(src_offs), _ints(dst_offs))):
        w = src[s:s + seg_words]
        if d >= 0:
            dst[d:d + seg_words].copy_(w)
        sums[i, 0] = w.sum()
        sums[i, 1] = (w * weights).sum()


def int8_load(staging: torch.Tensor, plan, rows, sums: torch.Tensor) -> None:
    """Dequantize a batch's staged int8 objects into its layers' caches and sum their payload
    words (per [layer, object], into ``sums`` [layers, objects, 2]) in one launch.
    ``staging``: uint8 device memory; ``plan``: an ``Int8Plan``, ``rows``: the batch's
    ``Int8Rows``, both with their tensors on the device."""
    n_dequant = plan.pages * 2 * plan.tcs
    grid = (n_dequant + plan.segments, len(rows.views))
    if grid[0] == 0:
        return
    dst = rows.dst
    t, h, d = dst.shape[2:]
    _int8_load_kernel[grid](staging.view(torch.int64), staging.view(torch.int8), staging.view(torch.float16),
                            dst, *plan.tensors, *rows.tensors, sums, n_dequant, rows.objects,
                            plan.block_words, *dst.stride(), T=t, H=h, D=d, TT=plan.tt,
                            BHD=triton.next_power_of_2(h * d), SEGW=plan.segw)


def load_rows_torch(src: torch.Tensor, dsts: list[torch.Tensor], segs: tuple[np.ndarray, ...],
                    obj_base: np.ndarray, layer_base: list[int], sums: torch.Tensor, seg_words: int) -> None:
    """``load_rows`` with torch ops, a layer at a time: layer r's cache is the word tensor
    ``dsts[r]``, starting ``layer_base[r]`` words in; the index arrays stay in numpy."""
    seg_obj, seg_payload, seg_cache = segs
    seg_sums = torch.empty((len(seg_obj), 2), dtype=torch.int64)
    for r, dst in enumerate(dsts):
        src_offs = obj_base[r][seg_obj] + seg_payload
        copy_segments_sum_torch(src, dst, src_offs, np.where(seg_cache >= 0, seg_cache + layer_base[r], -1),
                                seg_sums, seg_words)
        add_to_objects(seg_sums, seg_obj, seg_payload, sums[r])


def add_to_objects(seg_sums: torch.Tensor, seg_obj: np.ndarray, seg_payload: np.ndarray,
                   sums: torch.Tensor) -> None:
    """Add per-segment sums (``copy_segments_sum_torch``'s) into their objects' ``sums``
    [objects, 2], as the kernels do: a segment at payload word pw weighs its words pw more
    (its second column is shifted in place: ``seg_sums`` is used up)."""
    seg_sums[:, 1] += torch.from_numpy(np.asarray(seg_payload)).to(seg_sums.device) * seg_sums[:, 0]
    sums.index_add_(0, torch.from_numpy(np.asarray(seg_obj)).to(sums.device), seg_sums.to(sums.device))


def _ints(offsets) -> list[int]:
    return offsets.tolist() if hasattr(offsets, "tolist") else list(offsets)
