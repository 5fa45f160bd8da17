"""Moving KV blocks between vLLM's paged cache and pool objects in host memory.

A pool object is one layer's KV for one chunk (``blocks_per_chunk`` blocks):

    [32-byte header][block 0 page][block 1 page]...

The header binds the payload to its key and to the cache layout it was cut from, and
carries a CRC32, so a corrupted payload, a truncated object or an object stored under
the wrong key is detected before a byte reaches the KV cache.

A block's page is ``cache.select(block_dim, block_id)``: derived from the tensor's own
shape and strides, so the same code serves vLLM CPU's [blocks, heads, block, 2*dim],
FlashAttention's [2, blocks, block, heads, dim] and block-major re-strided caches.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass

import torch

MAGIC = b"ASKV"
HEADER = struct.Struct("<4sHH8sQII")  # magic, version, flags, fingerprint, payload, crc, pad
HEADER_BYTES = HEADER.size
HEADER_VERSION = 1


class CorruptObject(ValueError):
    pass


@dataclass(frozen=True)
class LayerLayout:
    """Where one layer's blocks live in its cache tensor."""

    tensor: torch.Tensor
    block_dim: int

    @classmethod
    def of(cls, tensor: torch.Tensor, num_blocks: int) -> "LayerLayout":
        dims = [d for d, n in enumerate(tensor.shape) if n == num_blocks]
        if not dims:
            raise ValueError(f"no dimension of size num_blocks={num_blocks} in a KV cache "
                             f"of shape {tuple(tensor.shape)}")
        if len(dims) > 1 and num_blocks == 2:
            # [2, 2, ...] is K/V-major or block-major alike; a wrong guess would move K or
            # V planes instead of blocks, so refuse.
            raise ValueError(f"cannot tell the block dimension of a KV cache of shape "
                             f"{tuple(tensor.shape)} with num_blocks=2")
        # Blocks are the outermost dimension of that size (heads or the block size may
        # equal num_blocks in small caches).
        return cls(tensor, max(dims, key=tensor.stride))

    @property
    def page_shape(self) -> tuple[int, ...]:
        shape = list(self.tensor.shape)
        del shape[self.block_dim]
        return tuple(shape)

    @property
    def page_bytes(self) -> int:
        n = 1
        for s in self.page_shape:
            n *= s
        return n * self.tensor.element_size()

    def describe(self) -> str:
        return f"{self.tensor.dtype}:{'x'.join(map(str, self.page_shape))}"

    def page(self, block_id: int) -> torch.Tensor:
        return self.tensor.select(self.block_dim, block_id)


def fingerprint(key: str, layout: str) -> bytes:
    return hashlib.blake2b(f"{key}|{layout}".encode(), digest_size=8).digest()


def object_bytes(layout: LayerLayout, blocks_per_chunk: int) -> int:
    return HEADER_BYTES + blocks_per_chunk * layout.page_bytes


def _pages(layout: LayerLayout, payload: torch.Tensor, n: int) -> torch.Tensor:
    """View ``payload`` (uint8) as ``n`` pages of the layer's dtype and page shape."""
    return payload.view(layout.tensor.dtype).view(n, *layout.page_shape)


def write_object(obj: torch.Tensor, layout: LayerLayout, block_ids: list[int], key: str,
                 checksum: bool) -> None:
    """Copy ``block_ids``' pages into ``obj`` (uint8 host memory) and seal it with a header."""
    payload = obj[HEADER_BYTES:]
    pages = _pages(layout, payload, len(block_ids))
    for i, b in enumerate(block_ids):
        pages[i].copy_(layout.page(b))
    crc = zlib.crc32(payload.numpy()) if checksum else 0
    header = HEADER.pack(MAGIC, HEADER_VERSION, int(checksum), fingerprint(key, layout.describe()),
                         payload.numel(), crc, 0)
    obj[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))


def read_object(obj: torch.Tensor, layout: LayerLayout, block_ids: list[int], skip: int, key: str,
                blocks_per_chunk: int, checksum: bool) -> None:
    """Check ``obj`` against ``key`` and the layout, then copy pages ``skip..`` into ``block_ids``."""
    if obj.numel() != object_bytes(layout, blocks_per_chunk):
        raise CorruptObject(f"{key}: size {obj.numel()} != {object_bytes(layout, blocks_per_chunk)}")
    magic, version, flags, fp, n, crc, _ = HEADER.unpack(obj[:HEADER_BYTES].numpy().tobytes())
    if magic != MAGIC or version != HEADER_VERSION:
        raise CorruptObject(f"{key}: bad header")
    if fp != fingerprint(key, layout.describe()):
        raise CorruptObject(f"{key}: stored for another key or cache layout")
    payload = obj[HEADER_BYTES:]
    if n != payload.numel():
        raise CorruptObject(f"{key}: payload length {n} != {payload.numel()}")
    if checksum and not flags & 1:
        raise CorruptObject(f"{key}: written without a checksum")
    if checksum and zlib.crc32(payload.numpy()) != crc:
        raise CorruptObject(f"{key}: checksum mismatch")
    pages = _pages(layout, payload, blocks_per_chunk)
    for i, b in enumerate(block_ids):
        layout.page(b).copy_(pages[skip + i])
