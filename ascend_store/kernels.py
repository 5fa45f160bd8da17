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
page's K or V rows into the cache or sum one stretch of an object's payload words, so a
layer's int8 objects land in one launch whatever their number.
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
    def _copy_segments_sum_kernel(src, dst, src_offs, dst_offs, sums, seg_words, BLOCK: tl.constexpr):
        seg = tl.program_id(0)
        part = tl.program_id(1)
        s = tl.load(src_offs + seg)
        d = tl.load(dst_offs + seg)
        idx = part * BLOCK + tl.arange(0, BLOCK)
        mask = idx < seg_words
        w = tl.load(src + s + idx, mask=mask, other=0)
        tl.store(dst + d + idx, w, mask=mask & (d >= 0))  # d < 0: read for the checksum only
        tl.atomic_add(sums + 2 * seg, tl.sum(w, axis=0))
        tl.atomic_add(sums + 2 * seg + 1, tl.sum(w * (idx + 1).to(tl.int64), axis=0))


    @triton.jit
    def _load_rows_kernel(src, dst, seg_obj, seg_payload, seg_cache, obj_base, layer_base, sums, n_segs,
                          n_objs, seg_words, BLOCK: tl.constexpr):
        seg = tl.program_id(0)
        part = tl.program_id(1)
        row = tl.program_id(2)  # a layer of the batch
        s = tl.load(obj_base + row * n_objs + tl.load(seg_obj + seg)) + tl.load(seg_payload + seg)
        c = tl.load(seg_cache + seg)
        d = tl.load(layer_base + row) + c
        idx = part * BLOCK + tl.arange(0, BLOCK)
        mask = idx < seg_words
        w = tl.load(src + s + idx, mask=mask, other=0)
        tl.store(dst + d + idx, w, mask=mask & (c >= 0))  # c < 0: read for the checksum only
        k = row * n_segs + seg
        tl.atomic_add(sums + 2 * k, tl.sum(w, axis=0))
        tl.atomic_add(sums + 2 * k + 1, tl.sum(w * (idx + 1).to(tl.int64), axis=0))


    @triton.jit
    def _int8_load_kernel(words, bytes_, halves, dst, page_obj, page_idx, page_block, obj_start, obj_n,
                          seg_obj, seg_word, sums, n_dequant, block_words, sb, skv, st, sh, sd,
                          T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, TT: tl.constexpr,
                          BHD: tl.constexpr, SEGW: tl.constexpr):
        pid = tl.program_id(0)
        if pid < n_dequant:  # one page's K (kv 0) or V (kv 1) rows [tc*TT, tc*TT + TT)
            tcs = (T + TT - 1) // TT
            p = pid // (2 * tcs)
            kv = (pid // tcs) % 2
            tc = pid % tcs
            o = tl.load(page_obj + p)
            pg = tl.load(page_idx + p)
            blk = tl.load(page_block + p)
            base = tl.load(obj_start + o)  # payload start, bytes (a multiple of 8)
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
            out = dst + blk * sb + kv * skv + t[:, None] * st
            out += (hd[None, :] // D) * sh + (hd[None, :] % D) * sd
            tl.store(out, x.to(dst.dtype.element_ty), mask=m)
        else:  # the word sums of one stretch of an object's payload (moved pages or not)
            s = pid - n_dequant
            o = tl.load(seg_obj + s)
            w0 = tl.load(seg_word + s)
            total = tl.load(obj_n + o) * block_words
            idx = w0 + tl.arange(0, SEGW)
            w = tl.load(words + tl.load(obj_start + o) // 8 + idx, mask=idx < total, other=0)
            tl.atomic_add(sums + 2 * o, tl.sum(w, axis=0))
            tl.atomic_add(sums + 2 * o + 1, tl.sum(w * (idx + 1).to(tl.int64), axis=0))


def copy_segments_sum(src, dst, src_offs: torch.Tensor, dst_offs: torch.Tensor, sums: torch.Tensor,
                      seg_words: int, block: int = 1024, num_warps: int = 4) -> None:
    """Copy ``len(src_offs)`` segments of ``seg_words`` 8-byte words (int64 tensors and
    word offsets on the device) and add each segment's word sums into ``sums[seg]``:
    (sum of w, sum of (j + 1) * w) over its words j, mod 2**64. A negative destination
    offset reads the segment for its sums without writing it."""
    n = src_offs.numel()
    if n == 0:
        return
    grid = (n, triton.cdiv(seg_words, block))
    _copy_segments_sum_kernel[grid](src, dst, src_offs, dst_offs, sums, seg_words, BLOCK=block,
                                    num_warps=num_warps)


def load_rows(src: torch.Tensor, dst: torch.Tensor, segs: torch.Tensor, obj_base: torch.Tensor,
              layer_base: torch.Tensor, sums: torch.Tensor, seg_words: int, block: int = 1024,
              num_warps: int = 4) -> None:
    """Copy the segments of ``len(layer_base)`` layers from staged objects into their caches
    and sum them (``sums`` [layers, segments, 2], zeroed). ``segs`` [3, segments]: each
    segment's object, word offset in that object's payload, and word offset in a layer's
    cache (-1: read for the checksum only); ``obj_base`` [layers, objects]: where each
    object's payload of that layer starts in ``src``; ``layer_base`` [layers]: where the
    layer's cache starts, in words from ``dst`` (the layers' caches may be separate
    allocations: addresses are flat on the device, so one base pointer reaches them all)."""
    n, rows = segs.shape[1], layer_base.numel()
    if n == 0 or rows == 0:
        return
    grid = (n, triton.cdiv(seg_words, block), rows)
    _load_rows_kernel[grid](src, dst, segs[0], segs[1], segs[2], obj_base, layer_base, sums, n,
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


def int8_load(staging: torch.Tensor, view: torch.Tensor, plan, sums: torch.Tensor) -> None:
    """Dequantize a layer's staged int8 objects into the cache and sum their payload words
    (per object, into ``sums`` [objects, 2]) in one launch. ``staging``: uint8 device
    memory; ``view``: the cache as [blocks, 2, T, H, D]; ``plan``: an ``Int8Plan`` with its
    tensors on the device."""
    n_dequant = plan.pages * 2 * plan.tcs
    grid = (n_dequant + plan.segments,)
    if grid[0] == 0:
        return
    t, h, d = view.shape[2:]
    _int8_load_kernel[grid](staging.view(torch.int64), staging.view(torch.int8), staging.view(torch.float16),
                            view, *plan.tensors, sums, n_dequant, plan.block_words, *view.stride(),
                            T=t, H=h, D=d, TT=plan.tt, BHD=triton.next_power_of_2(h * d), SEGW=plan.segw)


def load_rows_torch(src: torch.Tensor, dsts: list[torch.Tensor], segs: tuple[np.ndarray, ...],
                    obj_base: np.ndarray, layer_base: list[int], sums: torch.Tensor, seg_words: int) -> None:
    """``load_rows`` with torch ops, a layer at a time: layer r's cache is the word tensor
    ``dsts[r]``, starting ``layer_base[r]`` words in; the index arrays stay in numpy."""
    seg_obj, seg_payload, seg_cache = segs
    for r, dst in enumerate(dsts):
        src_offs = obj_base[r][seg_obj] + seg_payload
        copy_segments_sum_torch(src, dst, src_offs, np.where(seg_cache >= 0, seg_cache + layer_base[r], -1),
                                sums[r], seg_words)


def _ints(offsets) -> list[int]:
    return offsets.tolist() if hasattr(offsets, "tolist") else list(offsets)
