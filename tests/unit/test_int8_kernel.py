"""The int8 load kernel (kernels.int8_load) against its torch twin and the host codec, for a
batch of two layers.

The kernel runs wherever Triton can: under Triton's interpreter on CPU (a subprocess:
the interpreter is chosen when triton is imported) and natively on CUDA. The interpreter
rounds float32 -> bfloat16 by truncation, so the CPU run compares float32 caches; on CUDA
the bfloat16 cache must match the twin bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from ascend_store.common.codecs import get_codec
from ascend_store.common.transfer import HEADER_BYTES, LayerLayout
from ascend_store.device import int8_path, kernels
from ascend_store.device.segments import StepPages

NB, T, H, D = 12, 16, 2, 64
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def compare(device: str, dtype: torch.dtype, apart: bool) -> None:
    """Two layouts (FlashAttention's K/V apart; block-major), each a batch of two layers
    (``apart``: separate allocations, else two views of one), two objects of 3 and 2 blocks
    per layer (a prompt tail), a load that skips the first object's first page."""
    int8 = get_codec("int8")
    torch.manual_seed(0)
    shapes = {"fa": ((2, NB, T, H, D), 1), "blk": ((NB, H, T, 2 * D), 0)}
    for name, (shape, dim) in shapes.items():
        caches = [torch.randn(shape, dtype=dtype) for _ in range(2)]
        lays = [LayerLayout(c, dim, (H, T, D)) for c in caches]
        per = int8.payload_bytes(lays[0], 1)
        sizes = np.array([HEADER_BYTES + per * 3, HEADER_BYTES + per * 2])
        slot = -(-sizes // 8) * 8
        starts = (np.cumsum(np.tile(slot, 2)) - np.tile(slot, 2)).reshape(2, 2)  # [layer, object]
        staging = torch.zeros(int(slot.sum()) * 2, dtype=torch.uint8)
        for lay, layer_starts in zip(lays, starts):
            for blocks, s0, size in zip([[1, 4, 7], [9, 2]], layer_starts, sizes):
                int8.encode_into(lay, blocks, staging[s0 + HEADER_BYTES:s0 + size])
        pages = StepPages.of([[5, 6], [10, 11]], [1, 0], [3, 2])
        plan = int8_path.int8_plan(pages, np.array([3, 2]), per, T)

        want, want_sums = [], torch.zeros((2, 2, 2), dtype=torch.int64)
        for r, layer_starts in enumerate(starts):
            w = torch.zeros_like(caches[0])
            int8_path._load_torch(staging, LayerLayout(w, dim, (H, T, D)).canonical_blocks(), plan,
                                  layer_starts + HEADER_BYTES, want_sums[r])
            host = LayerLayout(torch.zeros_like(caches[0]), dim, (H, T, D))
            for (s0, size), n, skip, blocks in zip(zip(layer_starts, sizes), (3, 2), (1, 0),
                                                   ([5, 6], [10, 11])):
                int8.decode(host, staging[s0 + HEADER_BYTES:s0 + size], n, skip, blocks)
            assert torch.equal(w, host.tensor), name
            want.append(w)
            ref = torch.stack([int8_path.word_sums(staging[s0 + HEADER_BYTES:s0 + size].view(1, -1))[0]
                               for s0, size in zip(layer_starts, sizes)])
            assert torch.equal(want_sums[r], ref), name
        assert not torch.equal(want[0], want[1])  # the layers' caches differ: a mixed-up row shows

        both = torch.zeros((2, *shape), dtype=dtype, device=device)
        got = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)] if apart else list(both)
        views = [LayerLayout(g, dim, (H, T, D)).canonical_blocks() for g in got]
        rows = int8_path.int8_rows(views[::-1], starts[::-1])  # the lower cache second: offsets both ways
        sums = torch.zeros((2, 2, 2), dtype=torch.int64, device=device)
        if device == "cuda":
            int8_path.load_layers(staging.to(device), plan, rows, sums)
        else:
            plan.tensors = tuple(torch.from_numpy(a) for a in plan.arrays())
            rows.tensors = (torch.from_numpy(rows.obj_base.reshape(-1)), torch.from_numpy(rows.layer_off))
            kernels.int8_load(staging, plan, rows, sums)
        for r in range(2):
            assert torch.equal(got[r].cpu(), want[r]), name
        assert torch.equal(sums.cpu(), want_sums.flip(0)), name


def test_kernel_matches_twin_under_the_triton_interpreter():
    if kernels.triton is None:
        pytest.skip("triton is not installed")
    code = f"import torch, sys; sys.path.insert(0, {ROOT!r}); " \
           "from tests.unit.test_int8_kernel import compare; compare('cpu', torch.float32, False)"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("apart", [False, True], ids=["one-allocation", "apart"])
def test_kernel_matches_twin_on_cuda(apart):
    compare("cuda", torch.bfloat16, apart)
