"""One batched copy-and-sum per layer between a paged KV cache and staged pool objects.

A layer's blocks are copied as *segments* (a block's K part and V part in a
FlashAttention layout, or the whole page in a block-major one) of equal size, from
arbitrary source offsets to arbitrary destination offsets, summing every word on the
way (checksum.py). On CUDA one Triton kernel copies every segment of the layer in
device memory (the objects were staged by one DMA per run, device_path.py); elsewhere
the same plan runs as torch copies.
"""

from __future__ import annotations

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


def _ints(offsets) -> list[int]:
    return offsets.tolist() if hasattr(offsets, "tolist") else list(offsets)
