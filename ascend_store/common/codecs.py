"""Pool-side codecs: how one chunk's pages become an object payload and back.

- ``raw``: the pages' bytes as they are. Byte-exact, so it is also the pass-through for
  quantized KV caches (fp8 or int8 caches are stored as their own bytes).
- ``int8``: symmetric INT8 for floating-point caches. Per block, keys get one scale per
  (head, channel) (keys have outlier channels) and values one per (token, head); scales
  are fp16. Stored bytes: 1/2 of bf16 plus 1/(2T) + 1/(2D) for the scales (T tokens per
  block, D head size): 0.508x for block 128 and head size 128.
- ``zstd``: lossless compression of the raw bytes, for slow tiers; variable-size objects.

A codec is part of the namespace and of every object's header, so instances with
different codecs never read each other's objects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ascend_store.common.transfer import LayerLayout


class Codec(ABC):
    name: str
    cid: int
    fixed_size = True
    lossy = False  # a round trip gives back other bytes (close values)

    @abstractmethod
    def payload_bytes(self, layout: LayerLayout, n: int) -> int:
        """Payload size of ``n`` blocks (an upper bound for variable-size codecs)."""

    def check(self, layout: LayerLayout) -> None:
        """Raise ValueError at startup if this codec cannot encode the layout."""

    def encode_into(self, layout: LayerLayout, block_ids: list[int], payload: torch.Tensor) -> None:
        raise NotImplementedError

    def encode_bytes(self, layout: LayerLayout, block_ids: list[int]) -> bytes:
        raise NotImplementedError

    @abstractmethod
    def decode(self, layout: LayerLayout, payload: torch.Tensor, n: int, skip: int,
               block_ids: list[int]) -> None:
        """Write pages ``skip..skip+len(block_ids)`` of an ``n``-block payload into the cache."""


def _pages(layout: LayerLayout, payload: torch.Tensor, n: int) -> torch.Tensor:
    """View a uint8 payload as ``n`` pages of the layer's dtype and page shape."""
    return payload.view(layout.tensor.dtype).view(n, *layout.page_shape)


class RawCodec(Codec):
    name, cid = "raw", 0

    def payload_bytes(self, layout, n):
        return n * layout.page_bytes

    def encode_into(self, layout, block_ids, payload):
        pages = _pages(layout, payload, len(block_ids))
        for i, b in enumerate(block_ids):
            pages[i].copy_(layout.page(b))

    def decode(self, layout, payload, n, skip, block_ids):
        # One op for the object's pages, not one per block: a load thread then hands the
        # GIL to the forward once per object (async_loads.py), not once per block.
        scatter_pages(layout, _pages(layout, payload, n)[skip:skip + len(block_ids)], block_ids)


def scatter_pages(layout: LayerLayout, src: torch.Tensor, block_ids) -> None:
    """Write pages ``src`` [n, *page_shape] into blocks ``block_ids`` (a list or int array)."""
    blocks = layout.blocks()
    try:
        pages = src.to(blocks.device)  # pool memory on the host, the cache maybe on a device
        if blocks.element_size() == 1:  # fp8 has no index_copy_: the same bytes as uint8
            blocks, pages = blocks.view(torch.uint8), pages.view(torch.uint8)
        blocks.index_copy_(0, torch.as_tensor(block_ids, dtype=torch.long).to(blocks.device), pages)
    except (RuntimeError, NotImplementedError):  # a device or dtype without index_copy_
        for i, b in enumerate(list(block_ids)):
            layout.page(int(b)).copy_(src[i])


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pages [n, 2, T, H, D] -> int8 values of the same shape, key scales [n, H, D] and
    value scales [n, T, H] (fp16)."""
    x = x.float()
    k, v = x[:, 0], x[:, 1]  # [n, T, H, D]
    ks = (k.abs().amax(dim=1) / 127).clamp(min=6.2e-5, max=65504).half()
    vs = (v.abs().amax(dim=3) / 127).clamp(min=6.2e-5, max=65504).half()
    q = torch.stack([k / ks.float()[:, None], v / vs.float()[..., None]], dim=1)
    return q.round_().clamp_(-127, 127).to(torch.int8), ks, vs


def dequantize(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """The inverse of ``quantize``: float pages [n, 2, T, H, D]."""
    k, v = q[:, 0].float() * ks.float()[:, None], q[:, 1].float() * vs.float()[..., None]
    return torch.stack([k, v], dim=1)


class Int8Codec(Codec):
    name, cid = "int8", 1
    lossy = True

    def check(self, layout):
        if not layout.tensor.dtype.is_floating_point or layout.tensor.element_size() < 2:
            raise ValueError(f"codec int8 needs a 16- or 32-bit float KV cache, got {layout.tensor.dtype}: "
                             "a cache already quantized (fp8, int8 or C8 with its scales) is stored "
                             "byte-exact by codec raw (or zstd, lossless)")
        if layout.kv_dims is None or layout.canonical(layout.page(0)) is None:
            raise ValueError(f"codec int8 does not know the page layout {layout.describe()}")

    def _sizes(self, layout, n):
        h, t, d = layout.kv_dims
        return n * 2 * t * h * d, n * h * d, n * t * h

    def payload_bytes(self, layout, n):
        q, ks, vs = self._sizes(layout, n)
        return q + 2 * (ks + vs)

    def split_rows(self, layout, rows: torch.Tensor, n: int):
        """Views of payloads stacked as uint8 rows [N, bytes]: values [N, n, 2, T, H, D],
        key scales [N, n, H, D] and value scales [N, n, T, H]."""
        h, t, d = layout.kv_dims
        q, ks, vs = self._sizes(layout, n)
        m = rows.shape[0]
        return (rows[:, :q].view(torch.int8).view(m, n, 2, t, h, d),
                rows[:, q:q + 2 * ks].view(torch.float16).view(m, n, h, d),
                rows[:, q + 2 * ks:q + 2 * (ks + vs)].view(torch.float16).view(m, n, t, h))

    def encode_into(self, layout, block_ids, payload):
        q, k_scale, v_scale = (v[0] for v in self.split_rows(layout, payload.view(1, -1), len(block_ids)))
        x = layout.canonical_blocks()[torch.tensor(block_ids, device=layout.tensor.device)]
        for dst, src in zip((q, k_scale, v_scale), quantize(x)):
            dst.copy_(src)

    def decode(self, layout, payload, n, skip, block_ids):
        q, k_scale, v_scale = (v[0, skip:skip + len(block_ids)]
                               for v in self.split_rows(layout, payload.view(1, -1), n))
        view = layout.canonical_blocks()
        x = dequantize(q, k_scale, v_scale).to(view.device, view.dtype)  # the payload is in host memory
        view[torch.tensor(block_ids, device=view.device)] = x


class ZstdCodec(Codec):
    name, cid = "zstd", 2
    fixed_size = False

    def __init__(self, level: int = 3):
        import zstandard  # the "zstd" extra; checked when the codec is configured

        self._c = zstandard.ZstdCompressor(level=level)
        self._d = zstandard.ZstdDecompressor()

    def payload_bytes(self, layout, n):
        return n * layout.page_bytes + 1024

    def encode_bytes(self, layout, block_ids):
        raw = torch.empty(len(block_ids) * layout.page_bytes, dtype=torch.uint8)
        RAW.encode_into(layout, block_ids, raw)
        return self._c.compress(raw.numpy().tobytes())

    def decode(self, layout, payload, n, skip, block_ids):
        raw = self._d.decompress(payload.numpy().tobytes(), max_output_size=n * layout.page_bytes)
        if len(raw) != n * layout.page_bytes:
            raise ValueError("decompressed size does not match the layout")
        RAW.decode(layout, torch.frombuffer(bytearray(raw), dtype=torch.uint8), n, skip, block_ids)


RAW = RawCodec()


def get_codec(name: str) -> Codec:
    if name == "raw":
        return RAW
    if name == "int8":
        return Int8Codec()
    if name == "zstd":
        return ZstdCodec()
    raise ValueError(f"unknown codec {name!r}")
