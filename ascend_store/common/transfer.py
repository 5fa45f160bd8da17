"""Moving KV blocks between vLLM's paged cache and pool objects in host memory.

A pool object is one layer's KV for one chunk (``blocks_per_chunk`` blocks):

    [32-byte header][payload: the chunk's pages, encoded by the codec (codecs.py)]

The header binds the payload to its key, to the cache layout it was cut from and to the
codec, and carries a checksum (checksum.py's word sums, or a CRC32), so a corrupted
payload, a truncated object or an object stored under the wrong key is detected before a
byte reaches the KV cache.

On accelerators the payload moves in one batched copy per layer (segments.py) that
also computes a word checksum; the header says which checksum it carries.

A block's page is ``cache.select(block_dim, block_id)``: derived from the tensor's own
shape and strides, so the same code serves vLLM CPU's [blocks, heads, block, 2*dim],
FlashAttention's [2, blocks, block, heads, dim] and block-major re-strided caches.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ascend_store.common.checksum import wsum_host
from ascend_store.common.header import (
    ELEM_BF16,
    ELEM_F16,
    ELEM_F32,
    FLAG_CRC,
    FLAG_LOSSY,
    FLAG_WSUM,
    HEADER,
    HEADER_BYTES,
    HEADER_RECORD,
    HEADER_VERSION,
    MAGIC,
    RAW_CODEC,
)

_ELEMS = {torch.float32: ELEM_F32, torch.float16: ELEM_F16, torch.bfloat16: ELEM_BF16}

class CorruptObject(ValueError):
    pass


def storage_view(t: torch.Tensor, dtype: torch.dtype, offset: int = 0, size: tuple[int, ...] | None = None,
                 stride: tuple[int, ...] = (1,)) -> torch.Tensor:
    """A ``dtype`` view of ``t``'s whole storage (or of ``size``/``stride`` at ``offset``, in
    ``dtype`` elements), whatever shape ``t`` itself has."""
    storage = t.untyped_storage()
    if size is None:
        size = (storage.nbytes() // torch.empty(0, dtype=dtype).element_size(),)
    return torch.empty(0, dtype=dtype, device=t.device).set_(storage, offset, size, stride)


@dataclass(frozen=True)
class LayerLayout:
    """Where one layer's blocks live in its cache tensor.

    ``kv_dims`` = (KV heads, tokens per block, head size) when known, which lets codecs
    that need the meaning of the axes (int8) view a page as [K/V, token, head, channel].
    """

    tensor: torch.Tensor
    block_dim: int
    kv_dims: tuple[int, int, int] | None = None
    # A page's dims in memory order (by stride, outermost first): pages are stored and
    # copied in the order their bytes sit in the cache, so a dense page is one run of
    # bytes even when the backend's logical shape is permuted (FlashAttention's
    # (H, N, 2D) view of an (N, H, 2D) block in vLLM 0.26).
    order: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.order is None:
            strides = [s for d, s in enumerate(self.tensor.stride()) if d != self.block_dim]
            order = tuple(sorted(range(len(strides)), key=lambda d: -strides[d]))
            object.__setattr__(self, "order", order)

    @classmethod
    def of(cls, tensor: torch.Tensor, num_blocks: int,
           kv_dims: tuple[int, int, int] | None = None) -> LayerLayout:
        dims = [d for d, n in enumerate(tensor.shape) if n == num_blocks]
        if not dims:
            shape = tuple(tensor.shape)
            rows = next((n for n in shape if n > num_blocks and n % num_blocks == 0), None)
            why = (f" (its {rows} rows are num_blocks * {rows // num_blocks}: a cache replicated or split "
                   "per block, as vllm-ascend's indexer cache under decode context parallelism, whose "
                   "blocks no page layout here can address)" if rows else "")
            raise ValueError(f"no dimension of size num_blocks={num_blocks} in a KV cache of shape "
                             f"{shape}{why}")
        if len(dims) > 1 and num_blocks == 2:
            # [2, 2, ...] is K/V-major or block-major alike; a wrong guess would move K or
            # V planes instead of blocks, so refuse.
            raise ValueError(f"cannot tell the block dimension of a KV cache of shape "
                             f"{tuple(tensor.shape)} with num_blocks=2")
        # Blocks are the outermost dimension of that size (heads or the block size may
        # equal num_blocks in small caches).
        return cls(tensor, max(dims, key=tensor.stride), kv_dims)

    @cached_property
    def page_shape(self) -> tuple[int, ...]:
        shape = [s for d, s in enumerate(self.tensor.shape) if d != self.block_dim]
        return tuple(shape[d] for d in self.order)

    @cached_property
    def page_bytes(self) -> int:
        n = 1
        for s in self.page_shape:
            n *= s
        return n * self.tensor.element_size()

    def describe(self) -> str:
        return f"{self.tensor.dtype}:{'x'.join(map(str, self.page_shape))}"

    def page(self, block_id: int) -> torch.Tensor:
        return self.tensor.select(self.block_dim, block_id).permute(self.order)

    def blocks(self) -> torch.Tensor:
        """Every block's page as one view, blocks first: ``blocks()[b]`` is ``page(b)``."""
        return self.tensor.movedim(self.block_dim, 0).permute(0, *[d + 1 for d in self.order])

    def canonical(self, page: torch.Tensor) -> torch.Tensor | None:
        """A [2, tokens, heads, head_size] view of one page (or of pages stacked along
        leading dims), for the layouts we know: FlashAttention-style [2, T, H, D], vLLM
        CPU's [H, T, 2*D] and vLLM 0.26 GPU's [T, H, 2*D] (K, V side by side)."""
        if self.kv_dims is None:
            return None
        h, t, d = self.kv_dims
        lead = list(range(page.dim() - len(self.page_shape)))
        inner = tuple(page.shape[len(lead):])
        n = len(lead)
        if inner == (2, t, h, d):
            return page
        if inner == (h, t, 2 * d):
            return page.unflatten(-1, (2, d)).permute(*lead, n + 2, n + 1, n, n + 3)
        if inner == (t, h, 2 * d):
            return page.unflatten(-1, (2, d)).permute(*lead, n + 2, n, n + 1, n + 3)
        return None

    def canonical_blocks(self) -> torch.Tensor | None:
        """Every block's page as one [blocks, 2, tokens, heads, head_size] view."""
        return self.canonical(self.blocks())


def elem_of(layout: LayerLayout, codec) -> int:
    """The header's ``elem`` for ``layout``'s objects under ``codec`` (header.py): the float
    type of raw attention pages, which a pool tier may store as INT8; 0 otherwise."""
    if codec.cid != RAW_CODEC or layout.kv_dims is None:
        return 0
    return _ELEMS.get(layout.tensor.dtype, 0)


def fingerprints(keys: list[str], layout: LayerLayout, codec_name: str) -> bytes:
    """8 bytes per key binding an object to its key, the cache layout and the codec."""
    tail = f"|{layout.describe()}|{codec_name}".encode()
    return b"".join([hashlib.blake2b(k.encode() + tail, digest_size=8).digest() for k in keys])


def fingerprint(key: str, layout: LayerLayout, codec_name: str) -> bytes:
    return fingerprints([key], layout, codec_name)


def object_bytes(layout: LayerLayout, n: int, codec) -> int:
    """Size of a fixed-size codec's object of ``n`` blocks (header included)."""
    return HEADER_BYTES + codec.payload_bytes(layout, n)


def write_object(obj: torch.Tensor, layout: LayerLayout, block_ids: list[int], key: str,
                 checksum: bool, codec, salt: int = 0) -> None:
    """Encode ``block_ids``' pages into ``obj`` (host memory) and seal it."""
    codec.encode_into(layout, block_ids, obj[HEADER_BYTES:])
    seal(obj, obj.numel() - HEADER_BYTES, layout, key, codec, checksum, salt=salt)


def seal(obj: torch.Tensor, payload_len: int, layout: LayerLayout, key: str, codec, checksum: bool,
         wsum: int | None = None, salt: int = 0) -> None:
    """Write the header of an object whose payload is already in ``obj[HEADER_BYTES:]``
    (``wsum``: the word checksum a copy computed). Otherwise the word checksum is computed
    here when the payload is whole words, so the host load path checks a layer's parts in
    one pass (host_loads.py), and a CRC32 for other payloads (zstd). One object goes
    through struct, not ``seal_headers``: per object, that numpy pass slowed the host save
    path enough to halve the soak test's pool hits (65-78 against 129-233)."""
    payload = obj[HEADER_BYTES:HEADER_BYTES + payload_len]
    if not checksum:
        flags, crc = 0, 0
    elif wsum is not None:
        flags, crc = FLAG_WSUM, wsum
    elif payload_len % 8 == 0:
        flags, crc = FLAG_WSUM, wsum_host(payload.numpy())
    else:
        flags, crc = FLAG_CRC, zlib.crc32(payload.numpy())
    fp = int.from_bytes(fingerprint(key, layout, codec.name), "little") ^ salt
    header = HEADER.pack(MAGIC, HEADER_VERSION, flags, fp.to_bytes(8, "little"), payload_len, crc,
                         codec.cid, elem_of(layout, codec))
    obj[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))


def seal_headers(host: np.ndarray, offsets, payload_lens, keys: list[str] | np.ndarray,
                 layout: LayerLayout, codec, flags: int, sums) -> None:
    """Write the headers of many objects in ``host`` (uint8) at once (every layer part of
    a step's chunk objects): ``keys`` name them, or are their fingerprints already (uint64
    array); ``sums`` are their payloads' checksums of the kind ``flags`` names. The same
    bytes as ``seal`` per object (tests/unit/test_transfer.py)."""
    h = np.zeros(len(offsets), dtype=HEADER_RECORD)
    h["magic"], h["version"], h["flags"], h["codec"] = MAGIC, HEADER_VERSION, flags, codec.cid
    h["elem"] = elem_of(layout, codec)
    h["fp"] = keys if isinstance(keys, np.ndarray) else np.frombuffer(
        fingerprints(keys, layout, codec.name), dtype="<u8")
    h["payload"] = payload_lens
    h["crc"] = sums if flags else 0
    offs = np.asarray(offsets, dtype=np.int64)
    if not (offs % 8).any():  # 4 words per header: an eighth of the scattered elements
        words = HEADER_BYTES // 8
        host[:host.size // 8 * 8].view(np.uint64)[(offs // 8)[:, None] + np.arange(words)] = \
            h.view(np.uint64).reshape(-1, words)
    else:
        host[offs[:, None] + np.arange(HEADER_BYTES)] = h.view(np.uint8).reshape(-1, HEADER_BYTES)


def layer_salts(layer_ids) -> np.ndarray:
    """8 bytes per layer id (or ``id#part`` label), xor-ed into the fingerprint of that
    layer's part of a chunk object: one hash per chunk key serves every layer (a 32K hit
    has 128 chunk keys and 3,584 layer parts)."""
    return np.frombuffer(b"".join(hashlib.blake2b(f"L{i}".encode(), digest_size=8).digest()
                                  for i in layer_ids), dtype="<u8").copy()


FAULTS = ("size {size} does not fit {limit}", "bad header", "stored for another key or cache layout",
          "payload length {n} does not fit the object", "written without a checksum", "checksum mismatch")


def check_headers(host: np.ndarray, offs: np.ndarray, size: np.ndarray, expect: np.ndarray,
                  limit: np.ndarray, checksum: bool, codec,
                  wsum_later: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Check many objects at once (all layer parts of a step's chunk objects) against their
    expected fingerprints (key, layer, layout, codec) and payload sizes ``limit`` (the
    exact size for fixed-size codecs, a bound otherwise), and their payloads' checksums: a
    word checksum only unless ``wsum_later`` (the device copy computes it on the way).
    Returns a fault code per object (0: fine, else 1 + an index into FAULTS) and the
    headers (HEADER_RECORD)."""
    fits = (size >= HEADER_BYTES) & (size <= limit + HEADER_BYTES) & (offs >= 0) & (offs + size <= host.size)
    if codec.fixed_size:
        fits &= size == limit + HEADER_BYTES
    h = np.zeros(len(offs), dtype=HEADER_RECORD)
    if fits.all() and not (offs % 8).any():  # one gather of 4 words per header
        words = host[:host.size // 8 * 8].view(np.uint64)[(offs // 8)[:, None] + np.arange(HEADER_BYTES // 8)]
        h = words.view(HEADER_RECORD)[:, 0]
        fast = codec.fixed_size and (wsum_later or not checksum)
        if fast and _as_written(words, expect, size, codec, checksum):
            return np.zeros(len(offs), dtype=np.int64), h
    elif fits.any():
        h[fits] = host[offs[fits][:, None] + np.arange(HEADER_BYTES)].view(HEADER_RECORD)[:, 0]
    n = h["payload"].astype(np.int64)
    flags = h["flags"].astype(np.int64)
    bad = [
        ~fits,
        (h["magic"] != MAGIC) | (h["version"] != HEADER_VERSION) | (h["codec"] != codec.cid),
        h["fp"] != expect,
        (n < 0) | (n > size - HEADER_BYTES) | (codec.fixed_size & (n != size - HEADER_BYTES)),
        np.full(len(offs), checksum) & ((flags & (FLAG_CRC | FLAG_WSUM)) == 0),
    ]
    codes = np.select(bad, list(range(1, len(bad) + 1)), 0)
    if checksum:  # payload sums on the host: CRC32 (host writers), word sums unless later
        on_host = (flags & (FLAG_CRC if wsum_later else FLAG_CRC | FLAG_WSUM)) != 0
        for i in np.flatnonzero(on_host & (codes == 0)).tolist():
            payload = host[offs[i] + HEADER_BYTES:offs[i] + HEADER_BYTES + n[i]]
            if _payload_sum(payload, int(flags[i])) != int(h["crc"][i]):
                codes[i] = len(FAULTS)
    return codes, h


_HEAD0 = np.frombuffer(MAGIC + HEADER_VERSION.to_bytes(2, "little") + bytes(2), dtype="<u8")[0]
_LOW48, _U16 = np.uint64(2**48 - 1), np.uint64(0xFFFF)


def _as_written(words: np.ndarray, expect: np.ndarray, size: np.ndarray, codec, checksum: bool) -> bool:
    """The common case of ``check_headers`` in a few whole-array compares of the headers'
    words [objects, 4]: every fixed-size part is exactly as written for its key, size and
    codec, with a word checksum when one is required (compared later, on the device)."""
    ok = (words[:, 0] & _LOW48) == _HEAD0
    ok &= words[:, 1] == expect.astype(np.uint64)
    ok &= words[:, 2] == (size - HEADER_BYTES).astype(np.uint64)
    ok &= ((words[:, 3] >> np.uint64(32)) & _U16) == np.uint64(codec.cid)
    if checksum:  # a word checksum, from a writer or from a lossy tier's decode
        ok &= ((words[:, 0] >> np.uint64(48)) & ~np.uint64(FLAG_LOSSY)) == np.uint64(FLAG_WSUM)
    return bool(ok.all())


def fault_messages(codes: np.ndarray, h: np.ndarray, sizes, limit, label) -> list[str | None]:
    """Readable reasons for ``check_headers``' codes (``label(i)`` names object i)."""
    out: list[str | None] = [None] * len(codes)
    for i in np.flatnonzero(codes).tolist():
        out[i] = f"{label(i)}: " + FAULTS[codes[i] - 1].format(
            size=int(sizes[i]), limit=int(limit[i]) + HEADER_BYTES, n=int(h["payload"][i]))
    return out


def _payload_sum(payload: np.ndarray, flags: int) -> int:
    if flags & FLAG_CRC:
        return zlib.crc32(payload)
    return wsum_host(payload)


def decode_object(obj: torch.Tensor, n: int, layout: LayerLayout, block_ids: list[int], skip: int, key: str,
                  blocks_per_chunk: int, codec) -> None:
    """Decode a checked object's payload (``n`` bytes) pages ``skip..`` into ``block_ids``."""
    try:
        codec.decode(layout, obj[HEADER_BYTES:HEADER_BYTES + n], blocks_per_chunk, skip, block_ids)
    except CorruptObject:
        raise
    except Exception as exc:  # a payload the codec cannot decode is corrupt, not a crash
        raise CorruptObject(f"{key}: undecodable payload ({exc})") from None


def walk_parts(host: np.ndarray, offs: np.ndarray, sizes: np.ndarray,
                layers: int) -> tuple[np.ndarray, np.ndarray]:
    """[layer, object] offsets and sizes of the parts of variable-size objects, packed
    back to back (each rounded up to 8 bytes), found by reading each part's length. A
    length that leads outside its object gives the rest of the parts size 0 (refused)."""
    parts = np.zeros((layers, len(offs)), dtype=np.int64)
    out = np.zeros((layers, len(offs)), dtype=np.int64)
    for k, (off, size) in enumerate(zip(offs.tolist(), sizes.tolist())):
        at, end = off, off + size
        for i in range(layers):
            if at + HEADER_BYTES > end or end > host.size:
                break
            n = int(host[at:at + HEADER_BYTES].view(HEADER_RECORD)["payload"][0])
            part = HEADER_BYTES + n
            if at + part > end:
                break
            parts[i, k], out[i, k] = at, part
            at += -(-part // 8) * 8
    return parts, out
