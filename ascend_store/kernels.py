"""One batched copy per layer between a paged KV cache and host memory.

A layer's blocks are copied as *segments* (a block's K part and V part in a
FlashAttention layout, or the whole page in a block-major one) of equal size, from
arbitrary source offsets to arbitrary destination offsets. On CUDA one Triton kernel
copies every segment of the layer, reading or writing the pinned host arena directly
(zero-copy over the link), so per-block launch and DMA setup costs disappear and the
objects land in their own slots, headers in between untouched. Elsewhere the same plan
runs as torch copies.
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
    def _copy_segments_kernel(src, dst, src_offs, dst_offs, seg_words, BLOCK: tl.constexpr):
        seg = tl.program_id(0)
        part = tl.program_id(1)
        s = tl.load(src_offs + seg)
        d = tl.load(dst_offs + seg)
        idx = part * BLOCK + tl.arange(0, BLOCK)
        mask = idx < seg_words
        tl.store(dst + d + idx, tl.load(src + s + idx, mask=mask), mask=mask)


class HostPtr:
    """Lets a Triton kernel take a raw (registered) host address as an int64 pointer."""

    dtype = torch.int64

    def __init__(self, addr: int):
        self.addr = addr

    def data_ptr(self) -> int:
        return self.addr


def copy_segments(src, dst, src_offs: torch.Tensor, dst_offs: torch.Tensor, seg_words: int,
                  block: int = 1024, num_warps: int = 4) -> None:
    """Copy ``len(src_offs)`` segments of ``seg_words`` 8-byte words each.

    ``src``/``dst`` are int64 tensors or ``HostPtr``s; offsets are int64 tensors of word
    offsets (on the device for the Triton path).
    """
    n = src_offs.numel()
    if n == 0:
        return
    grid = (n, triton.cdiv(seg_words, block))
    _copy_segments_kernel[grid](src, dst, src_offs, dst_offs, seg_words, BLOCK=block, num_warps=num_warps)


def copy_segments_torch(src: torch.Tensor, dst: torch.Tensor, src_offs: list[int], dst_offs: list[int],
                        seg_words: int) -> None:
    """The same copy with torch ops (CPU, NPU, or any device without Triton)."""
    for s, d in zip(src_offs, dst_offs):
        dst[d:d + seg_words].copy_(src[s:s + seg_words], non_blocking=True)
