"""Codecs on real tensors: int8 accuracy and size, lossless round trips, corruption,
and byte-exact pass-through of quantized (fp8) caches."""

from __future__ import annotations

import pytest
import torch

from ascend_store.common.codecs import RAW, Int8Codec, ZstdCodec, get_codec
from ascend_store.common.transfer import (
    HEADER_BYTES,
    CorruptObject,
    LayerLayout,
    object_bytes,
    seal,
    write_object,
)
from tests.unit.objects import read_object

NB, H, T, D = 6, 4, 32, 64
KEY = "ns/g0/tp0of1/L0/abc"


def cpu_cache(dtype, gen):  # vLLM CPU: [blocks, heads, block, 2*head_dim]
    return torch.randn(NB, H, T, 2 * D, generator=gen).to(dtype)


def flash_cache(dtype, gen):  # FlashAttention: [2, blocks, block, heads, head_dim]
    return torch.randn(2, NB, T, H, D, generator=gen).to(dtype)


def nhd_cache(dtype, gen):  # vLLM 0.26 FlashAttention: logical [blocks, H, T, 2D], memory [blocks, T, H, 2D]
    return torch.randn(NB, T, H, 2 * D, generator=gen).to(dtype).permute(0, 2, 1, 3)


def with_outliers(cache: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """Scale a few key channels up to 30x, as real keys have outlier channels."""
    gen = torch.Generator().manual_seed(1)
    boost = torch.ones(H, D)
    boost.view(-1)[torch.randperm(H * D, generator=gen)[:16]] = torch.linspace(5, 30, 16)
    for b in range(NB):
        k = layout.canonical(layout.page(b))[0]
        k.copy_(k.float() * boost)
    return cache


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float(((a - b).pow(2).mean() / b.pow(2).mean()).sqrt())


def roundtrip(codec, src_layout, dst_layout, blocks, dst_blocks, skip=0):
    if codec.fixed_size:
        obj = torch.zeros(object_bytes(src_layout, len(blocks), codec), dtype=torch.uint8)
        write_object(obj, src_layout, blocks, KEY, True, codec)
    else:
        data = codec.encode_bytes(src_layout, blocks)
        obj = torch.zeros(HEADER_BYTES + len(data), dtype=torch.uint8)
        obj[HEADER_BYTES:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        seal(obj, len(data), src_layout, KEY, codec, True)
    read_object(obj, dst_layout, dst_blocks, skip, KEY, len(blocks), True, codec)
    return obj


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("make", [cpu_cache, flash_cache, nhd_cache], ids=["cpu", "flash", "nhd"])
def test_int8_error_within_one_percent_with_outlier_channels(dtype, make):
    gen = torch.Generator().manual_seed(0)
    src = make(dtype, gen)
    sl = LayerLayout.of(src, NB, (H, T, D))
    with_outliers(src, sl)
    dst = torch.zeros_like(src)
    dl = LayerLayout.of(dst, NB, (H, T, D))
    codec = Int8Codec()
    codec.check(sl)
    roundtrip(codec, sl, dl, [1, 4], [0, 5])
    assert dst.dtype == src.dtype and dst.shape == src.shape
    for s, d in ((1, 0), (4, 5)):
        k_err = rel_rms(dl.canonical(dl.page(d))[0], sl.canonical(sl.page(s))[0])
        v_err = rel_rms(dl.canonical(dl.page(d))[1], sl.canonical(sl.page(s))[1])
        assert k_err <= 0.01 and v_err <= 0.01, (k_err, v_err)
    for b in (1, 2, 3, 4):  # untouched blocks stay zero
        assert not dl.page(b).any()


def test_int8_skip_writes_only_the_tail_blocks():
    gen = torch.Generator().manual_seed(0)
    src, dst = cpu_cache(torch.bfloat16, gen), torch.zeros(NB, H, T, 2 * D, dtype=torch.bfloat16)
    sl, dl = LayerLayout.of(src, NB, (H, T, D)), LayerLayout.of(dst, NB, (H, T, D))
    roundtrip(Int8Codec(), sl, dl, [0, 1, 2], [3], skip=2)
    assert rel_rms(dl.page(3), sl.page(2)) < 0.01
    assert not dst[[0, 1, 2, 4, 5]].any()


def test_int8_size_against_bf16():
    for t, d, bound in ((128, 128, 0.51), (32, 128, 0.53), (16, 128, 0.54)):
        cache = torch.zeros(3, 8, t, 2 * d, dtype=torch.bfloat16)
        layout = LayerLayout.of(cache, 3, (8, t, d))
        ratio = Int8Codec().payload_bytes(layout, 4) / RAW.payload_bytes(layout, 4)
        assert ratio == pytest.approx(0.5 + 1 / (2 * t) + 1 / (2 * d))
        assert ratio <= bound


def test_int8_refuses_quantized_and_unknown_layouts():
    fp8 = torch.zeros(NB, H, T, 2 * D, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="float KV cache"):
        Int8Codec().check(LayerLayout.of(fp8, NB, (H, T, D)))
    odd = torch.zeros(NB, T, 3 * D)
    with pytest.raises(ValueError, match="page layout"):
        Int8Codec().check(LayerLayout.of(odd, NB, (H, T, D)))


def test_zstd_is_byte_exact_and_compresses_redundant_pages():
    src = torch.zeros(NB, H, T, 2 * D, dtype=torch.bfloat16)
    src[:, :, :, :8] = torch.randn(NB, H, T, 8).bfloat16()
    dst = torch.zeros_like(src)
    sl, dl = LayerLayout.of(src, NB, (H, T, D)), LayerLayout.of(dst, NB, (H, T, D))
    codec = ZstdCodec()
    obj = roundtrip(codec, sl, dl, [2, 3], [2, 3])
    assert torch.equal(dst[2:4].view(torch.int16), src[2:4].view(torch.int16))
    assert obj.numel() < RAW.payload_bytes(sl, 2) / 4


@pytest.mark.parametrize("name", ["raw", "int8", "zstd"])
def test_corrupted_header_or_payload_is_detected(name):
    codec = get_codec(name)
    gen = torch.Generator().manual_seed(0)
    src = cpu_cache(torch.bfloat16, gen)
    dst = torch.zeros_like(src)
    sl, dl = LayerLayout.of(src, NB, (H, T, D)), LayerLayout.of(dst, NB, (H, T, D))
    obj = roundtrip(codec, sl, dl, [0, 1], [0, 1])
    for where, match in ((HEADER_BYTES + 3, "checksum"), (1, "bad header")):
        bad = obj.clone()
        bad[where] ^= 0x10
        with pytest.raises(CorruptObject, match=match):
            read_object(bad, dl, [0, 1], 0, KEY, 2, True, codec)
    other = get_codec("raw" if name != "raw" else "int8")
    with pytest.raises(CorruptObject):  # an object of another codec is never decoded
        read_object(obj, dl, [0, 1], 0, KEY, 2, True, other)


def test_zstd_garbage_payload_without_checksum_is_corrupt_not_a_crash():
    src = torch.zeros(NB, H, T, 2 * D, dtype=torch.bfloat16)
    sl = LayerLayout.of(src, NB, (H, T, D))
    obj = roundtrip(ZstdCodec(), sl, sl, [0], [0])
    obj[HEADER_BYTES:HEADER_BYTES + 8] = 0x55
    with pytest.raises(CorruptObject, match="undecodable"):
        read_object(obj, sl, [0], 0, KEY, 1, False, ZstdCodec())


def test_fp8_cache_passes_through_raw_byte_exact():
    """A quantized (fp8) KV cache is stored as its own bytes: nothing is re-quantized."""
    gen = torch.Generator().manual_seed(0)
    src = (torch.randn(NB, H, T, 2 * D, generator=gen) * 3).to(torch.float8_e4m3fn)
    dst = torch.zeros_like(src)
    sl, dl = LayerLayout.of(src, NB, (H, T, D)), LayerLayout.of(dst, NB, (H, T, D))
    roundtrip(RAW, sl, dl, [1, 2, 3], [5, 0, 4])
    for s, d in ((1, 5), (2, 0), (3, 4)):
        assert torch.equal(dst[d].view(torch.uint8), src[s].view(torch.uint8))
