"""Pool objects <-> paged KV caches: layouts, round trips and corruption detection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascend_store.common.codecs import RAW
from ascend_store.common.transfer import (
    FLAG_WSUM,
    HEADER_BYTES,
    CorruptObject,
    LayerLayout,
    check_headers,
    fingerprints,
    object_bytes,
    seal,
    seal_headers,
    write_object,
)
from tests.unit.objects import read_object

NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM = 6, 2, 4, 8
KEY = "ns/g0/tp0of1/L3/0123456789abcdef"


def _fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return t


def cpu_cache(num_blocks=NUM_BLOCKS, dtype=torch.float32):
    # vLLM CPU: [num_blocks, kv_heads, block_size, 2 * head_dim]
    return torch.zeros(num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=dtype)


def flash_cache(num_blocks=NUM_BLOCKS, dtype=torch.bfloat16):
    # FlashAttention-like: [2, num_blocks, block_size, kv_heads, head_dim]
    return torch.zeros(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype)


def block_major_cache(num_blocks=NUM_BLOCKS, dtype=torch.bfloat16):
    # Allocated block-major, viewed as [2, num_blocks, ...]: the block dim has the largest stride.
    t = torch.zeros(num_blocks, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype).permute(1, 0, 2, 3, 4)
    assert not t.is_contiguous()
    return t


LAYOUTS = {
    "vllm_cpu": (cpu_cache, 0, (KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)),
    "flash": (flash_cache, 1, (2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)),
    "block_major": (block_major_cache, 1, (2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)),
}


@pytest.fixture(params=list(LAYOUTS))
def layout_case(request):
    return LAYOUTS[request.param]


def _pair(make):
    src = _fill(make(), seed=1)
    dst = make()
    return src, LayerLayout.of(src, NUM_BLOCKS), dst, LayerLayout.of(dst, NUM_BLOCKS)


def _written(src_layout, block_ids=(1, 4), key=KEY, checksum=True, codec=RAW):
    obj = torch.zeros(object_bytes(src_layout, len(block_ids), RAW), dtype=torch.uint8)
    write_object(obj, src_layout, list(block_ids), key, checksum=checksum, codec=RAW)
    return obj


def _page(t, dim, b):
    return t.select(dim, b)


# -- layouts -----------------------------------------------------------------------------

def test_layout_finds_block_dim(layout_case):
    make, dim, page_shape = layout_case
    layout = LayerLayout.of(make(), NUM_BLOCKS)
    assert layout.block_dim == dim
    assert layout.page_shape == page_shape
    n = 1
    for s in page_shape:
        n *= s
    assert layout.page_bytes == n * make().element_size()


def test_layout_ambiguous_sizes_pick_block_dim():
    # num_blocks equal to another dimension must still find the block dimension.
    assert LayerLayout.of(cpu_cache(num_blocks=BLOCK_SIZE), BLOCK_SIZE).block_dim == 0
    if KV_HEADS != 2:
        assert LayerLayout.of(cpu_cache(num_blocks=KV_HEADS), KV_HEADS).block_dim == 0
    assert LayerLayout.of(flash_cache(num_blocks=BLOCK_SIZE), BLOCK_SIZE).block_dim == 1
    assert LayerLayout.of(block_major_cache(num_blocks=BLOCK_SIZE), BLOCK_SIZE).block_dim == 1
    # With two blocks, [2, 2, ...] is K/V-major or block-major alike: refused, not guessed.
    with pytest.raises(ValueError, match="num_blocks=2"):
        LayerLayout.of(block_major_cache(num_blocks=2), 2)


def test_layout_flash_with_two_blocks():
    try:
        dim = LayerLayout.of(flash_cache(num_blocks=2), 2).block_dim
    except ValueError:
        return  # refusing an ambiguous layout is as good as finding the right dim
    assert dim == 1


def test_layout_without_block_dim_fails():
    with pytest.raises(ValueError, match="num_blocks=7"):
        LayerLayout.of(cpu_cache(), 7)


def test_describe_distinguishes_dtype_and_shape():
    a = LayerLayout.of(cpu_cache(), NUM_BLOCKS).describe()
    assert a != LayerLayout.of(cpu_cache(dtype=torch.bfloat16), NUM_BLOCKS).describe()
    assert a != LayerLayout.of(torch.zeros(NUM_BLOCKS, 4, 4, 8), NUM_BLOCKS).describe()


# -- round trips -------------------------------------------------------------------------

def test_round_trip(layout_case):
    make, dim, _ = layout_case
    src, sl, dst, dl = _pair(make)
    obj = _written(sl, (1, 4))
    assert obj.numel() == HEADER_BYTES + 2 * sl.page_bytes
    src_before = src.clone()
    read_object(obj, dl, [5, 0], 0, KEY, 2, checksum=True, codec=RAW)
    assert torch.equal(src, src_before)  # writing never touches the source
    assert torch.equal(_page(dst, dim, 5), _page(src, dim, 1))
    assert torch.equal(_page(dst, dim, 0), _page(src, dim, 4))
    assert not torch.equal(_page(dst, dim, 5), _page(dst, dim, 0))
    for b in (1, 2, 3, 4):
        assert not _page(dst, dim, b).any(), f"block {b} was touched"


def test_round_trip_with_skip(layout_case):
    make, dim, _ = layout_case
    src, sl, dst, dl = _pair(make)
    obj = _written(sl, (1, 4))
    read_object(obj, dl, [3], 1, KEY, 2, checksum=True, codec=RAW)
    assert torch.equal(_page(dst, dim, 3), _page(src, dim, 4))
    for b in (0, 1, 2, 4, 5):
        assert not _page(dst, dim, b).any(), f"block {b} was touched"


def test_round_trip_between_layouts_of_same_page():
    # A block-major cache and a FlashAttention cache have the same page shape and dtype:
    # an object written from one is readable into the other.
    src = _fill(block_major_cache(), seed=3)
    dst = flash_cache()
    obj = _written(LayerLayout.of(src, NUM_BLOCKS), (0, 2))
    read_object(obj, LayerLayout.of(dst, NUM_BLOCKS), [2, 0], 0, KEY, 2, checksum=True, codec=RAW)
    assert torch.equal(dst[:, 2], src[:, 0])
    assert torch.equal(dst[:, 0], src[:, 2])


def test_object_depends_only_on_content():
    src = _fill(cpu_cache(), seed=5)
    sl = LayerLayout.of(src, NUM_BLOCKS)
    a = _written(sl, (1, 4))
    b = torch.full((object_bytes(sl, 2, RAW),), 0xAB, dtype=torch.uint8)  # dirty buffer
    write_object(b, sl, [1, 4], KEY, checksum=True, codec=RAW)
    assert torch.equal(a, b)


def test_headers_sealed_at_once_equal_one_by_one():
    # The batched path writes a layer's headers in one pass: byte for byte what sealing
    # each object alone writes, for every key and checksum.
    sl = LayerLayout.of(_fill(cpu_cache(), seed=6), NUM_BLOCKS)
    size = object_bytes(sl, 2, RAW)
    keys, sums = [f"{KEY}/{i}" for i in range(5)], [7, 0, 2**32 - 1, 12345, 99]
    payload = _fill(torch.empty(5 * size // 4, dtype=torch.float32), seed=7).view(torch.uint8)
    one, many = payload.clone(), payload.clone()
    for i, (key, wsum) in enumerate(zip(keys, sums)):
        seal(one[i * size:(i + 1) * size], size - HEADER_BYTES, sl, key, RAW, True, wsum=wsum)
    seal_headers(many.numpy(), [i * size for i in range(5)], [size - HEADER_BYTES] * 5, keys, sl, RAW,
                 FLAG_WSUM, sums)
    assert torch.equal(one, many)
    assert not torch.equal(one[:HEADER_BYTES], payload[:HEADER_BYTES])


# -- corruption --------------------------------------------------------------------------

def _assert_rejected(obj, dl, dst, key=KEY, match=None):
    with pytest.raises(CorruptObject, match=match):
        read_object(obj, dl, [0, 5], 0, key, 2, checksum=True, codec=RAW)
    assert not dst.any(), "a corrupt object reached the cache"


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_payload_byte_detected(layout_case, where):
    _, sl, dst, dl = _pair(layout_case[0])
    obj = _written(sl)
    pos = {"first": HEADER_BYTES, "middle": (HEADER_BYTES + obj.numel()) // 2, "last": obj.numel() - 1}
    obj[pos[where]] ^= 0x10
    _assert_rejected(obj, dl, dst, match="checksum")


# Header: magic 0-3, version 4-5, flags 6-7, fingerprint 8-15, payload length 16-23,
# crc 24-27, pad 28-31.
PROTECTED_HEADER_BYTES = [*range(6), *range(8, 28)]


@pytest.mark.parametrize("pos", PROTECTED_HEADER_BYTES)
def test_flipped_header_byte_detected(pos):
    _, sl, dst, dl = _pair(cpu_cache)
    obj = _written(sl)
    obj[pos] ^= 0x01
    _assert_rejected(obj, dl, dst)


@pytest.mark.parametrize("pos", range(HEADER_BYTES))
def test_flipped_header_byte_never_yields_wrong_data(pos):
    src, sl, dst, dl = _pair(cpu_cache)
    obj = _written(sl)
    obj[pos] ^= 0xFF
    try:
        read_object(obj, dl, [0, 5], 0, KEY, 2, checksum=True, codec=RAW)
    except CorruptObject:
        assert not dst.any()
    else:
        assert torch.equal(dst[0], src[1]) and torch.equal(dst[5], src[4])


def test_other_key_rejected(layout_case):
    _, sl, dst, dl = _pair(layout_case[0])
    obj = _written(sl)
    _assert_rejected(obj, dl, dst, key=KEY.replace("L3", "L4"), match="another key")


@pytest.mark.parametrize("delta", [-1, 1, 512, -HEADER_BYTES])
def test_wrong_size_buffer_rejected(delta):
    _, sl, dst, dl = _pair(cpu_cache)
    obj = _written(sl)
    n = obj.numel() + delta
    other = torch.zeros(n, dtype=torch.uint8)
    other[:min(n, obj.numel())] = obj[:min(n, obj.numel())]
    _assert_rejected(other, dl, dst, match="size")


def test_wrong_blocks_per_chunk_rejected():
    _, sl, dst, dl = _pair(cpu_cache)
    obj = _written(sl)
    with pytest.raises(CorruptObject):
        read_object(obj, dl, [0], 0, KEY, 1, checksum=True, codec=RAW)
    with pytest.raises(CorruptObject):
        read_object(obj, dl, [0, 1, 2], 0, KEY, 3, checksum=True, codec=RAW)
    assert not dst.any()


@pytest.mark.parametrize("other", [
    torch.zeros(NUM_BLOCKS, 4, BLOCK_SIZE, HEAD_DIM),  # same page bytes, other shape
    torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 4 * HEAD_DIM, dtype=torch.bfloat16),  # other dtype
    torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.bfloat16),  # smaller page
    torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.int32),  # same bytes, int
], ids=["shape", "dtype", "smaller", "int32"])
def test_other_layout_rejected(other):
    sl = LayerLayout.of(_fill(cpu_cache(), seed=1), NUM_BLOCKS)
    obj = _written(sl)
    ol = LayerLayout.of(other, NUM_BLOCKS)
    with pytest.raises(CorruptObject):
        read_object(obj, ol, [0, 5], 0, KEY, 2, checksum=True, codec=RAW)
    assert not other.any()


def test_without_checksum_payload_flip_is_not_detected():
    """Documented trade-off: checksum=False skips the CRC, so payload corruption gets through."""
    src, sl, dst, dl = _pair(cpu_cache)
    # Written without a CRC: a reader that asks for verification refuses it...
    obj = _written(sl, checksum=False, codec=RAW)
    obj[HEADER_BYTES + 5] ^= 0x40
    with pytest.raises(CorruptObject, match="without a checksum"):
        read_object(obj, dl, [0, 5], 0, KEY, 2, checksum=True, codec=RAW)
    # ...and a reader that does not verify takes the corrupted bytes.
    read_object(obj, dl, [0, 5], 0, KEY, 2, checksum=False, codec=RAW)
    assert not torch.equal(dst[0], src[1])
    assert torch.equal(dst[5], src[4])
    # Written with a CRC but read without verification: not detected either.
    dst.zero_()
    obj = _written(sl, checksum=True, codec=RAW)
    obj[HEADER_BYTES + 5] ^= 0x40
    read_object(obj, dl, [0, 5], 0, KEY, 2, checksum=False, codec=RAW)
    assert not torch.equal(dst[0], src[1])
    # ...but the key binding is still checked without a checksum.
    dst.zero_()
    with pytest.raises(CorruptObject):
        read_object(obj, dl, [0, 5], 0, "other", 2, checksum=False, codec=RAW)
    assert not dst.any()


@pytest.mark.parametrize("pos", [*range(6), *range(8, 24), 28, 29])
def test_headers_checked_at_once_find_the_one_flipped_byte(pos):
    # The batched load checks a step's parts in one pass, whole-array compares first:
    # a part whose magic, version, fingerprint, length or codec differs by one bit is
    # found among parts written as expected, and only it.
    sl = LayerLayout.of(_fill(cpu_cache(), seed=6), NUM_BLOCKS)
    size = object_bytes(sl, 2, RAW)
    keys = [f"{KEY}/{i}" for i in range(6)]
    host = np.zeros(6 * size, dtype=np.uint8)
    offs = np.arange(6, dtype=np.int64) * size
    seal_headers(host, offs, [size - HEADER_BYTES] * 6, keys, sl, RAW, FLAG_WSUM, [1, 2, 3, 4, 5, 6])
    expect = np.frombuffer(fingerprints(keys, sl, RAW.name), dtype="<u8")
    sizes, limit = np.full(6, size), np.full(6, size - HEADER_BYTES)
    codes, h = check_headers(host, offs, sizes, expect, limit, True, RAW, wsum_later=True)
    assert not codes.any() and h["crc"].tolist() == [1, 2, 3, 4, 5, 6]
    host[4 * size + pos] ^= 0x01
    codes, _ = check_headers(host, offs, sizes, expect, limit, True, RAW, wsum_later=True)
    assert np.flatnonzero(codes).tolist() == [4]
