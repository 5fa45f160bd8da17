"""The worker on an NPU without host pinning, on CPU: vllm-ascend's tuple caches as npu
tensors, the real worker (PoolWorker, as the connector's worker half drives it) and a
real local pool, with the NPU faked only at the device-runtime boundary.

What is faked (tests/unit/fake_npu.py): torch_npu, i.e. the ``npu`` device type,
``torch.npu``'s streams and events, and NPU memory, which is host memory behind a tensor
subclass whose device is ``npu`` (PyTorch cannot make npu tensors without torch_npu:
renaming privateuse1 alone leaves it without an allocator, a device guard or kernels;
the subclass plus PyTorch's Python-backend guard is the smallest thing that does). CANN
is the stub driver (tests/backends/ascend_stub/driver_stub.c) built as libascendcl.so
without the host-registration entry points, reached through device/platform.py's real ctypes
path, or no libascendcl.so at all. Everything else is real: registration of (K, V) and
MLA (nope, rope) tuples allocated the way vllm-ascend's model runner allocates them
(raw int8 buffers viewed as the cache dtype and shape), the pool, the objects' headers
and checksums, the per-block copies.

What it proves: an NPU without host registration starts (registration succeeds), ``copy_path:
auto`` takes the per-block path and says why once, and a save + load round trip of tuple
caches on an ``npu`` device is byte-exact. What it cannot: that torch_npu's real
copies between NPU and host memory behave as these host copies do, or anything of the
batched path on an NPU (it reads device addresses, which a fake cannot give): both need
Ascend hardware (docs/ascend.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

import pytest
import torch

from ascend_store.common.config import StoreConfig
from ascend_store.common.metadata import ChunkLoad, ChunkSave, StepMetadata
from ascend_store.worker.pool_worker import PoolWorker
from tests.unit import fake_npu
from tests.unit.test_npu_device import _cann

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from lookup import fake_vllm  # noqa: E402

LAYERS, BLOCK = 2, 16
CHUNK_BLOCKS = 256 // BLOCK  # the default chunk size
NUM_BLOCKS = 4 * CHUNK_BLOCKS + 1  # block 0 is vLLM's null block
SHAPES = {"kv": [(2, 64), (2, 64)],  # (kv heads, head dim) of K and of V
          "mla": [(1, 512), (1, 64)]}  # the latent (nope) and the rope key: last dims differ


def _loadable(lib: str) -> bool:
    try:
        ctypes.CDLL(lib)
        return True
    except OSError:
        return False


def _npu_caches(kind: str) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per layer, one raw int8 npu buffer per part viewed as bf16 [blocks, block, heads,
    dim], as vllm-ascend's model runner builds them, filled with random values."""
    g = torch.Generator().manual_seed(1)
    caches = {}
    for i in range(LAYERS):
        parts = []
        for heads, dim in SHAPES[kind]:
            shape = (NUM_BLOCKS, BLOCK, heads, dim)
            raw = torch.zeros(NUM_BLOCKS * BLOCK * heads * dim * 2, dtype=torch.int8, device="npu")
            part = raw.view(torch.bfloat16).view(shape)
            part.copy_(torch.randn(shape, generator=g).to(torch.bfloat16))
            parts.append(part)
        caches[f"model.layers.{i}.self_attn.attn"] = tuple(parts)
    return caches


@pytest.mark.parametrize("cann", ["no_host_register", "absent"])
@pytest.mark.parametrize("kind", ["kv", "mla"])
def test_npu_worker_without_pinning_round_trips_tuple_caches_per_block(pool, kind, cann, monkeypatch,
                                                                       tmp_path, caplog):
    npu = fake_npu.install(monkeypatch)
    if cann == "absent":
        monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "nowhere"))
        monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
        if _loadable("libascendcl.so"):
            pytest.skip("a libascendcl.so is on the loader path")
        why = "libascendcl.so not found"
    else:
        _cann(tmp_path, monkeypatch, host_register=False)
        why = "this CANN has no aclrtHostRegisterV2, aclrtHostGetDevicePointer, aclrtHostUnregister"
    caches = _npu_caches(kind)
    first = next(iter(caches.values()))[0]
    assert first.device.type == "npu" and first.dtype == torch.bfloat16

    vllm_config, kv_cache_config = fake_vllm(LAYERS, BLOCK)
    kv_cache_config.num_blocks = NUM_BLOCKS
    cfg = StoreConfig.parse({"copy_path": "auto", "local": {"socket": pool.socket, "start": "never"}})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    with caplog.at_level(logging.INFO, logger="ascend_store"):
        worker.register_kv_caches(caches)
        assert len(worker.order) == 2 * LAYERS  # every tuple part registered

        src = list(range(1, 2 * CHUNK_BLOCKS + 1))  # two chunks
        dst = list(range(2 * CHUNK_BLOCKS + 1, 4 * CHUNK_BLOCKS + 1))
        chunks = lambda ids: [ids[c * CHUNK_BLOCKS:(c + 1) * CHUNK_BLOCKS] for c in range(2)]  # noqa: E731
        save = StepMetadata(saves=[ChunkSave("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(src))],
                            commit_now=True)  # published when wait_for_save returns
        for name in caches:
            worker.save_kv_layer(name, save)
        worker.wait_for_save(save)
        assert worker.counters.total["saved_objects"] == 2  # one object per chunk, every part inside
        want = {n: tuple(t.cpu()[src] for t in parts) for n, parts in caches.items()}

        load = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))])
        worker.handle_preemptions(load)
        worker.start_load_kv(load)
        for name in caches:
            worker.wait_for_layer_load(name)
        assert worker.get_block_ids_with_load_errors() == set()
        assert worker.counters.total["loaded_objects"] == 2
        for name, parts in caches.items():
            for t, w in zip(parts, want[name]):
                assert t.device.type == "npu"
                assert torch.equal(t.cpu()[dst], w), name
        worker.shutdown()

    # Which path ran: per-block copies, no side stream or event ever asked of torch.npu
    # (the batched path makes a load and a save stream at registration).
    assert worker.device_path is None and fake_npu.FakeStream.made == []
    assert npu.compute.waited == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings  # said once, at registration
    assert warnings[0].startswith(f"ascend-store: the pool's memory cannot be pinned on npu ({why}")
    assert warnings[0].endswith("copying block by block")
    assert "ascend-store: copy path per_block on npu" in [r.getMessage() for r in caplog.records]
