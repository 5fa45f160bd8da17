"""The device layer's CPU side and the segment copy plan (the CUDA kernel runs in
benchmarks/transfer.py on a GPU, which checks its bytes; CI has no GPU)."""

from __future__ import annotations

import torch

from ascend_store.device.kernels import copy_segments_sum_torch
from ascend_store.device.platform import Device


def test_cpu_device_needs_no_streams_or_pinning():
    d = Device(torch.device("cpu"))
    assert not d.is_accelerator
    assert d.stream() is None and d.record() is None
    d.wait(None)
    assert d.pin(bytearray(4096)) is False
    with d.use(None):
        pass


def test_copy_segments_moves_each_segment_to_its_slot():
    src = torch.arange(64, dtype=torch.int64)
    dst = torch.full((100,), -1, dtype=torch.int64)
    sums = torch.empty((3, 2), dtype=torch.int64)
    copy_segments_sum_torch(src, dst, [8, 40, 0], [90, 10, 50], sums, 8)
    assert sums[0].tolist() == [sum(range(8, 16)), sum((i + 1) * w for i, w in enumerate(range(8, 16)))]
    assert torch.equal(dst[90:98], src[8:16])
    assert torch.equal(dst[10:18], src[40:48])
    assert torch.equal(dst[50:58], src[0:8])
    assert (dst[:10] == -1).all() and (dst[18:50] == -1).all() and (dst[58:90] == -1).all()
