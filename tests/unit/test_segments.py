"""The zero-copy path's plan and checksum, run with its CPU implementation (torch ops).

The GPU runs the same plan through one Triton kernel per layer (benchmarks/layerwise.py
and benchmarks/transfer.py measure it); here we check what both share: which bytes go
where, that objects are byte-identical to the host path's, and that the checksum the copy
accumulates is the one the header carries and catches damage.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ascend_store.common.checksum import wsum_host
from ascend_store.common.codecs import get_codec
from ascend_store.common.transfer import (
    HEADER_BYTES,
    CorruptObject,
    LayerLayout,
    object_bytes,
    seal,
    write_object,
)
from ascend_store.device.segments import fold_alike, page_plan, run_copy, storage_words, to_device_rows
from tests.unit.objects import plan_objects, read_object

NB, T, H, D = 8, 16, 2, 8
RAW = get_codec("raw")


def _caches():
    """The same KV in three layouts: FlashAttention [2, blocks, T, H, D] (K and V apart),
    vLLM CPU [blocks, H, T, 2D] and a block-major page inside a shared buffer."""
    torch.manual_seed(0)
    fa = torch.randn(2, NB, T, H, D, dtype=torch.bfloat16)
    cpu = torch.randn(NB, H, T, 2 * D, dtype=torch.bfloat16)
    shared = torch.zeros(NB * 2 * H * T * 2 * D, dtype=torch.bfloat16)
    paged = torch.as_strided(shared, (NB, H, T, 2 * D), (2 * H * T * 2 * D, T * 2 * D, 2 * D, 1),
                             H * T * 2 * D)  # the second layer of each block
    paged.copy_(torch.randn(NB, H, T, 2 * D))
    # vLLM 0.26 FlashAttention: logical (blocks, H, T, 2D) over memory laid out (blocks, T, H, 2D).
    nhd = torch.randn(NB, T, H, 2 * D, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    return {"fa": (fa, 1), "cpu": (cpu, 0), "paged": (paged, 0), "nhd": (nhd, 0)}


@pytest.mark.parametrize("name", ["fa", "cpu", "paged", "nhd"])
def test_plan_segments_follow_the_page_layout(name):
    """A page is cut where its bytes are apart, not where its logical shape says: the
    permuted (H, T, 2D) view of a dense (T, H, 2D) block is still one segment (it was 2*H*T
    segments of 2D elements before pages followed memory order: 6 us per token on a GPU)."""
    cache, block_dim = _caches()[name]
    plan = page_plan(LayerLayout(cache, block_dim))
    assert len(plan.offsets) == (2 if name == "fa" else 1)
    assert plan.page_bytes == cache.select(block_dim, 0).numel() * 2


@pytest.mark.parametrize("name", ["fa", "cpu", "paged", "nhd"])
def test_save_by_segments_equals_the_host_path_and_carries_its_checksum(name):
    cache, block_dim = _caches()[name]
    layout = LayerLayout(cache, block_dim)
    blocks = [5, 2, 7]
    size = object_bytes(layout, len(blocks), RAW)
    arena = torch.zeros(2 * size + 64, dtype=torch.uint8)
    copy = plan_objects(page_plan(layout), [(64, blocks, 0)], load=False)
    sums = run_copy(copy, storage_words(cache), storage_words(arena), arena.device)
    (wsum,) = fold_alike([sums])[0][0].tolist()
    obj = arena[64:64 + size]
    seal(obj, size - HEADER_BYTES, layout, "k", RAW, checksum=True, wsum=wsum)
    host = torch.zeros(size, dtype=torch.uint8)
    write_object(host, layout, blocks, "k", True, RAW)
    assert torch.equal(obj[HEADER_BYTES:], host[HEADER_BYTES:])  # same payload bytes
    assert wsum == wsum_host(obj[HEADER_BYTES:].numpy())
    other = torch.zeros_like(cache)
    read_object(obj, LayerLayout(other, block_dim), [1, 3, 4], 0, "k", 3, True, RAW)  # verifies wsum
    for src, dst in zip(blocks, [1, 3, 4]):
        assert torch.equal(other.select(block_dim, dst), cache.select(block_dim, src))


def test_load_by_segments_reads_skipped_pages_for_the_checksum_only():
    cache, block_dim = _caches()["fa"]
    layout = LayerLayout(cache, block_dim)
    size = object_bytes(layout, 3, RAW)
    arena = torch.zeros(size, dtype=torch.uint8)
    write_object(arena, layout, [0, 1, 2], "k", True, RAW)  # the host path, with a CRC32
    target = torch.zeros_like(cache)
    copy = plan_objects(page_plan(layout), [(0, [6, 7], 1)], load=True)  # pages 1, 2 -> blocks 6, 7
    sums = run_copy(copy, storage_words(arena), storage_words(target), target.device)
    assert not target.select(block_dim, 0).any()  # page 0 was not written anywhere
    assert torch.equal(target.select(block_dim, 6), cache.select(block_dim, 1))
    assert torch.equal(target.select(block_dim, 7), cache.select(block_dim, 2))
    want = wsum_host(arena[HEADER_BYTES:].numpy())
    assert fold_alike([sums])[0][0].tolist() == [want]


def test_word_checksum_catches_every_single_bit_flip_and_reordered_words():
    """Every bit of the first and last words (high bits included: a sum that moved both
    s1 and s2 alike once slipped through a plain xor of the two)."""
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 256, 4096, dtype=np.uint8)
    base = wsum_host(payload)
    for byte in list(range(8)) + list(range(4088, 4096)):
        for bit in range(8):
            flipped = payload.copy()
            flipped[byte] ^= 1 << bit
            assert wsum_host(flipped) != base, (byte, bit)
    swapped = payload.copy().view(np.uint64)
    swapped[[3, 9]] = swapped[[9, 3]]
    assert wsum_host(swapped.view(np.uint8)) != base


def test_a_damaged_segment_copied_object_is_rejected():
    cache, block_dim = _caches()["cpu"]
    layout = LayerLayout(cache, block_dim)
    size = object_bytes(layout, 2, RAW)
    arena = torch.zeros(size, dtype=torch.uint8)
    copy = plan_objects(page_plan(layout), [(0, [3, 4], 0)], load=False)
    sums = run_copy(copy, storage_words(cache), storage_words(arena), arena.device)
    (wsum,) = fold_alike([sums])[0][0].tolist()
    seal(arena, size - HEADER_BYTES, layout, "k", RAW, checksum=True, wsum=wsum)
    arena[HEADER_BYTES + 33] ^= 0x10
    with pytest.raises(CorruptObject, match="checksum mismatch"):
        read_object(arena, layout, [0, 1], 0, "k", 2, True, RAW)


@pytest.mark.parametrize("gap", [0, 24])
def test_stage_layout_puts_every_part_where_its_batch_reads_it(gap):
    """A batch's parts, staged by the spans ``stage_layout`` returns, sit at the offsets it
    returns for them: one span per object when the layers' parts are back to back (chunk
    objects, gap 0), one per part otherwise. Parts of a shorter tail object included."""
    from ascend_store.device.segments import stage_layout

    rng = np.random.default_rng(3)
    arena = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    per_block = np.array([96, 96, 96])  # three layers, 96 payload bytes a block
    blocks = np.array([4, 4, 2])  # the last object is a prompt's tail
    sizes = HEADER_BYTES + per_block[:, None] * blocks[None, :]
    parts = np.zeros_like(sizes)
    for o, start in enumerate([512, 4096, 9000]):
        parts[:, o] = start + np.concatenate([[0], np.cumsum(sizes[:-1, o] + gap)])
    spans, widths, staged, starts = stage_layout(parts, sizes)
    assert spans.shape[0] == (1 if gap == 0 else 3)
    staging = np.zeros(int((-(-widths // 8) * 8).sum()), dtype=np.uint8)
    for g in range(spans.shape[0]):
        for o in range(spans.shape[1]):
            a, w = spans[g, o], widths[g, o]
            staging[staged[g, o]:staged[g, o] + w] = arena[a:a + w]
    for layer in range(3):
        for o in range(3):
            got = staging[starts[layer, o]:starts[layer, o] + sizes[layer, o]]
            assert np.array_equal(got, arena[parts[layer, o]:parts[layer, o] + sizes[layer, o]])


def test_batches_laid_out_alike_share_one_dma_plan_shifted():
    """A step's one-layer batches of chunk objects sit at the same distances from their
    first part: ``dma_plans`` plans one and shifts it; each equals planning it alone. With
    a prompt's shorter tail object the layers' parts drift apart: each plans alone."""
    from ascend_store.device.segments import dma_plan, dma_plans

    part = 4096
    objects = np.array([0, 1, 2, 5]) * 40 * part  # the last one is elsewhere in the arena
    for blocks in ([4, 4, 4, 4], [4, 4, 4, 2]):
        sizes = HEADER_BYTES + part * np.array(blocks)  # per object, one layer's part
        batches = [((objects + layer * sizes)[None], sizes[None]) for layer in range(6)]
        for (parts, sz), got in zip(batches, dma_plans(batches)):
            want = dma_plan(parts, sz)
            assert got[0] == want[0] and got[1] == want[1] and np.array_equal(got[2], want[2])


def test_rows_uploaded_together_each_start_on_16_bytes():
    """Triton specializes a kernel on the 16-byte alignment of each pointer argument: index
    arrays packed back to back would start at odd words with odd lengths before them."""
    arrays = [np.arange(n, dtype=np.int64) + 100 * n for n in (1, 3, 0, 5, 2)]
    rows = to_device_rows(arrays, torch.device("cpu"))
    assert [r.data_ptr() % 16 for r in rows] == [0] * len(arrays)
    assert [r.tolist() for r in rows] == [a.tolist() for a in arrays]
