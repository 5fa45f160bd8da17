"""The host load path's batched layer copy (host_loads.py) against objects written by the
host writer: pages land byte-exact (skipped pages stay), and a corrupt object fails alone
with its blocks untouched, whichever checksum its header carries."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from ascend_store.common.codecs import RAW
from ascend_store.common.transfer import (
    FLAG_CRC,
    FLAG_WSUM,
    HEADER_BYTES,
    HEADER_RECORD,
    LayerLayout,
    object_bytes,
    seal_headers,
    write_object,
)
from ascend_store.device.segments import StepPages
from ascend_store.worker import host_loads

BLOCKS, PAGES = 24, 4  # cache blocks; pages per object


def _setup(n_objects: int):
    g = torch.Generator().manual_seed(0)
    src = LayerLayout(torch.randn(BLOCKS, 2, 16, 2 * 8, generator=g), 0)  # vLLM CPU's [blocks, H, T, 2D]
    size = object_bytes(src, PAGES, RAW)
    arena = torch.zeros(64 + n_objects * size, dtype=torch.uint8)
    starts = np.arange(n_objects, dtype=np.int64) * size + 64
    for k, at in enumerate(starts.tolist()):
        blocks = list(range(1 + k * PAGES, 1 + (k + 1) * PAGES))
        write_object(arena[at:at + size], src, blocks, f"k{k}", True, RAW)
    dst = LayerLayout(torch.zeros_like(src.tensor), 0)
    return src, dst, arena, starts, size


def _load(dst, arena, starts, blocks, skips, verify=True):
    pages = StepPages.of(blocks, skips, [PAGES] * len(blocks))
    host = arena.numpy()
    headers = np.stack([host[s:s + HEADER_BYTES].view(HEADER_RECORD)[0] for s in starts.tolist()])
    live = np.ones(len(starts), dtype=bool)
    return host_loads.load_layer(host_loads.words_of(arena), host, dst, pages, starts, headers, live, verify,
                                 host_loads.Scratch(), host_loads.WriteGate())


def test_pages_land_byte_exact_and_skipped_pages_stay():
    src, dst, arena, starts, _ = _setup(3)
    assert (arena.numpy()[starts[0]:starts[0] + HEADER_BYTES].view(HEADER_RECORD)["flags"] == FLAG_WSUM).all()
    blocks = [[13, 14, 15, 16], [18, 19], [20, 21, 22, 23]]
    faults = _load(dst, arena, starts, blocks, [0, 1, 0])
    assert len(faults.entries) == 0
    for k, (b, skip) in enumerate(zip(blocks, [0, 1, 0])):
        for i, block in enumerate(b):
            assert torch.equal(dst.page(block), src.page(1 + k * PAGES + skip + i))
    assert not dst.tensor[[17, 0]].any()  # object 1's first (skipped) page was not written


@pytest.mark.parametrize("batch", [1, 1 << 20])  # a batch per object (the page size rounds up), or one
@pytest.mark.parametrize("checksum", ["wsum", "crc32"])
@pytest.mark.parametrize("page", [0, 3])  # a moved page, or a page read only for the checksum
def test_a_corrupt_object_fails_alone(checksum, page, batch, monkeypatch):
    monkeypatch.setattr(host_loads, "BATCH_BYTES", batch)
    src, dst, arena, starts, size = _setup(3)
    host = arena.numpy()
    if checksum == "crc32":  # an object sealed by an older host writer
        payload = host[starts[1] + HEADER_BYTES:starts[1] + size]
        seal_headers(host, [starts[1]], [size - HEADER_BYTES], ["k1"], src, RAW, FLAG_CRC,
                     [zlib.crc32(payload)])
    host[starts[1] + HEADER_BYTES + page * src.page_bytes + 5] ^= 0x10
    blocks = [[13, 14, 15, 16], [17, 18, 19], [20, 21, 22, 23]]
    faults = _load(dst, arena, starts, blocks, [0, 0, 0])
    assert faults.entries.tolist() == [1] and faults.why == ["checksum mismatch"]
    assert not dst.tensor[[17, 18, 19]].any()  # the corrupt object's blocks untouched
    assert torch.equal(dst.tensor[13:17], src.tensor[1:5])
    assert torch.equal(dst.tensor[20:24], src.tensor[9:13])


def test_no_checksum_fails_when_verifying_and_loads_when_not():
    src, dst, arena, starts, size = _setup(2)
    host = arena.numpy()
    seal_headers(host, [starts[0]], [size - HEADER_BYTES], ["k0"], src, RAW, 0, [0])
    blocks = [[13, 14, 15, 16], [17, 18, 19, 20]]
    faults = _load(dst, arena, starts, blocks, [0, 0])
    assert faults.entries.tolist() == [0] and faults.why == ["written without a checksum"]
    assert not dst.tensor[13:17].any() and torch.equal(dst.tensor[17:21], src.tensor[5:9])
    assert len(_load(dst, arena, starts, blocks, [0, 0], verify=False).entries) == 0
    assert torch.equal(dst.tensor[13:17], src.tensor[1:5])


def test_unaligned_or_coded_parts_take_the_per_object_path():
    src, _, _, starts, _ = _setup(1)
    assert host_loads.batched(src, RAW, starts)
    assert not host_loads.batched(src, RAW, starts + 4)
