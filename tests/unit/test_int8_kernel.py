"""The int8 load kernel (kernels.int8_load) against its torch twin and the host codec.

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


def compare(device: str, dtype: torch.dtype) -> None:
    """Two layouts (FlashAttention's K/V apart; block-major), two objects of 3 and 2
    blocks (a prompt tail), a load that skips the first object's first page."""
    int8 = get_codec("int8")
    torch.manual_seed(0)
    caches = {"fa": (torch.randn(2, NB, T, H, D, dtype=dtype), 1),
              "blk": (torch.randn(NB, H, T, 2 * D, dtype=dtype), 0)}
    for name, (cache, dim) in caches.items():
        lay = LayerLayout(cache, dim, (H, T, D))
        per = int8.payload_bytes(lay, 1)
        sizes = np.array([HEADER_BYTES + per * 3, HEADER_BYTES + per * 2])
        slot = -(-sizes // 8) * 8
        starts = np.cumsum(slot) - slot
        staging = torch.zeros(int(slot.sum()), dtype=torch.uint8)
        for blocks, s0, size in zip([[1, 4, 7], [9, 2]], starts, sizes):
            int8.encode_into(lay, blocks, staging[s0 + HEADER_BYTES:s0 + size])
        pages = StepPages.of([[5, 6], [10, 11]], [1, 0], [3, 2])
        plan = int8_path.int8_plan(pages, starts, np.array([3, 2]), per, T)

        want = torch.zeros_like(cache)
        want_sums = torch.zeros((2, 2), dtype=torch.int64)
        int8_path._load_torch(staging, LayerLayout(want, dim, (H, T, D)).canonical_blocks(), plan, want_sums)
        host = LayerLayout(torch.zeros_like(cache), dim, (H, T, D))
        for (s0, size), n, skip, blocks in zip(zip(starts, sizes), (3, 2), (1, 0), ([5, 6], [10, 11])):
            int8.decode(host, staging[s0 + HEADER_BYTES:s0 + size], n, skip, blocks)
        assert torch.equal(want, host.tensor), name
        ref = torch.stack([int8_path.word_sums(staging[s0 + HEADER_BYTES:s0 + size].view(1, -1))[0]
                           for s0, size in zip(starts, sizes)])
        assert torch.equal(want_sums, ref), name

        got = torch.zeros_like(cache, device=device)
        if device == "cuda":
            view = LayerLayout(got, dim, (H, T, D)).canonical_blocks()
            sums = int8_path.load_layer(staging.to(device), view, plan)
        else:
            sums = torch.zeros((2, 2), dtype=torch.int64)
            plan.tensors = tuple(torch.from_numpy(a) for a in plan.arrays())
            kernels.int8_load(staging, LayerLayout(got, dim, (H, T, D)).canonical_blocks(), plan, sums)
        assert torch.equal(got.cpu(), want), name
        assert torch.equal(sums.cpu(), want_sums), name


def test_kernel_matches_twin_under_the_triton_interpreter():
    if kernels.triton is None:
        pytest.skip("triton is not installed")
    code = f"import torch, sys; sys.path.insert(0, {ROOT!r}); " \
           "from tests.unit.test_int8_kernel import compare; compare('cpu', torch.float32)"
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_matches_twin_on_cuda():
    compare("cuda", torch.bfloat16)
