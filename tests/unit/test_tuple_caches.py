"""vllm-ascend's per-layer cache tuples through the real worker and a real local pool.

vllm-ascend hands connectors one tuple per layer instead of one tensor: (K, V) split caches
of shape [blocks, block, kv heads, head dim] each, or MLA's (nope, rope) pair whose last
dims differ (512 and 64). Each tensor is its own part of the chunk object. A save of one
prompt's blocks and a load of them into other blocks (a full hit) must be byte-exact on
both copy paths; the pool object holds every part.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from ascend_store.common.config import StoreConfig
from ascend_store.common.metadata import ChunkLoad, ChunkSave, StepMetadata
from ascend_store.worker.pool_worker import PoolWorker

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from lookup import fake_vllm  # noqa: E402

LAYERS, BLOCK = 3, 16
CHUNK_BLOCKS = 256 // BLOCK  # the default chunk size
NUM_BLOCKS = 4 * CHUNK_BLOCKS + 1  # block 0 is vLLM's null block


def _caches(kind: str) -> dict[str, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    if kind in ("kv", "int8"):  # [blocks, block, kv heads, head dim], K and V apart
        shapes = [(NUM_BLOCKS, BLOCK, 2, 64)] * 2
    else:  # MLA: the latent (nope) and the rope key, one "head"
        shapes = [(NUM_BLOCKS, BLOCK, 1, 512), (NUM_BLOCKS, BLOCK, 1, 64)]
    if kind == "int8":  # the INT8 KV cache plugin's pages: int8 values, passed through byte-exact
        make = lambda s: torch.randint(-128, 128, s, generator=g, dtype=torch.int8)  # noqa: E731
    else:
        make = lambda s: torch.randn(s, generator=g).to(torch.bfloat16)  # noqa: E731
    return {f"model.layers.{i}.self_attn.attn": tuple(make(s) for s in shapes) for i in range(LAYERS)}


@pytest.mark.parametrize("copy_path", ["per_block", "batched"])
@pytest.mark.parametrize("kind", ["kv", "mla", "int8"])
def test_tuple_caches_round_trip_byte_exact(pool, kind, copy_path):
    vllm_config, kv_cache_config = fake_vllm(LAYERS, BLOCK)
    kv_cache_config.num_blocks = NUM_BLOCKS
    cfg = StoreConfig.parse({"copy_path": copy_path, "local": {"socket": pool.socket, "start": "never"}})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    caches = _caches(kind)
    worker.register_kv_caches(caches)
    assert len(worker.order) == 2 * LAYERS and len(worker.ctx.groups) == 1
    assert (worker.device_path is not None) == (copy_path == "batched")

    src = list(range(1, 2 * CHUNK_BLOCKS + 1))  # two chunks
    dst = list(range(2 * CHUNK_BLOCKS + 1, 4 * CHUNK_BLOCKS + 1))
    save = StepMetadata(saves=[ChunkSave("r", 0, f"{c:032x}", src[c * CHUNK_BLOCKS:(c + 1) * CHUNK_BLOCKS])
                               for c in range(2)], commit_now=True)  # published when wait_for_save returns
    for name in caches:
        worker.save_kv_layer(name, save)
    worker.wait_for_save(save)
    assert worker.counters.total["saved_objects"] == 2  # one object per chunk, every part inside
    want = {n: tuple(t[src].clone() for t in parts) for n, parts in caches.items()}

    load = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", dst[c * CHUNK_BLOCKS:(c + 1) * CHUNK_BLOCKS])
                               for c in range(2)])
    worker.handle_preemptions(load)
    worker.start_load_kv(load)
    for name in caches:
        worker.wait_for_layer_load(name)
    assert worker.get_block_ids_with_load_errors() == set()
    for name, parts in caches.items():
        for t, w in zip(parts, want[name]):
            assert torch.equal(t[dst], w), name
    assert worker.counters.total["loaded_objects"] == 2
    worker.shutdown()
