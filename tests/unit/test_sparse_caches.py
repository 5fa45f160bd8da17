"""Sparse-attention caches through the real worker and a real local pool, byte-exact.

- vLLM's DeepSeek-V3.2 layout, from the installed vLLM's own definitions: the MLA layer's
  spec (``MLAAttentionSpec``: the 576-wide bf16 latent, or ``fp8_ds_mla``'s 656-byte
  token of fp8 NoPE, scales and bf16 RoPE) and the indexer's (``SparseCacheRole.INDEXER``,
  132 bytes: 128 fp8 keys and their fp32 scale), in the two KV cache groups vLLM makes of
  them (their cache roles never merge), allocated by vLLM's ``allocate_kv_cache``.
- vllm-ascend's tuples for sparse attention (SFA/DSA), per its model runner's source
  (tests/contract/test_ascend_contract.py checks every shape and dtype used here against
  it): ``(k, v, dsa_k)``, ``(k, v, dsa_k, dsa_k_scale)``, ``(k, dsa_k)``, ``(k, dsa_k,
  dsa_k_scale)`` and ``(k,)``, in BF16 and in C8 (int8 with fp16 scales; fp8 e4m3 with
  fp32 scales on A5).
- A first dimension of ``num_blocks * replicas`` (vllm-ascend's indexer under decode
  context parallelism) stops the engine at start, naming the layer and the shape.

A save of two chunks and a load of them into other blocks must give every part of every
layer back bit for bit, on both copy paths. What this cannot show: the kernels that read
these caches (FlashMLA sparse on CUDA, SFA on an NPU).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from vllm.v1.attention.backend import KVCacheLayout
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SparseCacheRole,
)
from vllm.v1.worker.utils import allocate_kv_cache

from ascend_store.common.config import StoreConfig
from ascend_store.common.metadata import ChunkLoad, ChunkSave, StepMetadata
from ascend_store.worker.pool_worker import PoolWorker

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from lookup import fake_vllm  # noqa: E402

LAYERS = 2
CHUNKS = 2


def _mla_config(block: int):
    vllm_config, _ = fake_vllm(LAYERS, block)
    vllm_config.model_config.use_mla = True  # one latent for every TP rank: stored once
    return vllm_config


def _vllm_sparse_caches(fmt: str, layout: KVCacheLayout, block: int, num_blocks: int):
    """DeepSeek-V3.2's MLA and indexer caches as vLLM's model specifies and allocates them."""
    main = MLAAttentionSpec(block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=576,
                            dtype=torch.uint8 if fmt == "fp8_ds_mla" else torch.bfloat16,
                            cache_dtype_str=fmt, is_index_group_leader=True,
                            state_content_bytes=656 if fmt == "fp8_ds_mla" else None)
    indexer = MLAAttentionSpec(block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=128 + 4,
                               dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
    with pytest.raises(AssertionError):  # vLLM keeps them in groups of their own
        MLAAttentionSpec.merge([main, indexer])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    groups = [KVCacheGroupSpec(names, main),
              KVCacheGroupSpec([n + ".indexer.k_cache" for n in names], indexer)]
    total = sum(LAYERS * g.kv_cache_spec.page_size_bytes * num_blocks for g in groups)
    tensors, offset = [], 0
    for g in groups:
        page = g.kv_cache_spec.page_size_bytes
        tensors.append(KVCacheTensor(size=total, layers=g.layer_names, layer_stride=page * num_blocks,
                                     block_stride=page, offset=offset))
        offset += LAYERS * page * num_blocks
    kv_cache_config = KVCacheConfig(num_blocks, tensors, groups)
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)
    return kv_cache_config, caches


def _round_trip(worker: PoolWorker, caches: dict, groups: int, per_chunk: int, num_blocks: int):
    """Save CHUNKS chunks of each group from blocks 1.., load them into the blocks after."""
    n = CHUNKS * per_chunk
    src, dst = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1))
    assert dst[-1] < num_blocks

    def chunks(kind, blocks):
        return [kind("r", g, f"{c:032x}", blocks[c * per_chunk:(c + 1) * per_chunk])
                for g in range(groups) for c in range(CHUNKS)]

    save = StepMetadata(saves=chunks(ChunkSave, src), commit_now=True)
    for name in caches:
        worker.save_kv_layer(name, save)
    worker.wait_for_save(save)
    assert worker.counters.total["saved_objects"] == groups * CHUNKS  # one object per group and chunk

    def pages(t, blocks):
        return t[blocks].clone()

    want = {n: [pages(t, src) for t in (c if isinstance(c, tuple) else (c,))] for n, c in caches.items()}
    load = StepMetadata(loads=chunks(ChunkLoad, dst))
    worker.handle_preemptions(load)
    worker.start_load_kv(load)
    for name in caches:
        worker.wait_for_layer_load(name)
    assert worker.get_block_ids_with_load_errors() == set()
    for name, c in caches.items():
        for t, w in zip(c if isinstance(c, tuple) else (c,), want[name]):
            assert torch.equal(t[dst].view(torch.uint8), w.view(torch.uint8)), name
    assert worker.counters.total["loaded_objects"] == groups * CHUNKS
    worker.shutdown()


def _fill(caches: dict) -> None:
    g = torch.Generator().manual_seed(0)
    for c in caches.values():
        for t in c if isinstance(c, tuple) else (c,):
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g,
                                                    dtype=torch.uint8))


@pytest.mark.parametrize("copy_path", ["per_block", "batched"])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.BLHNC])
@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
def test_vllm_deepseek_v32_main_and_indexer_caches_round_trip(pool, fmt, layout, copy_path):
    block = 64  # FlashMLA sparse and the indexer read 64-token pages
    per_chunk = 256 // block
    num_blocks = 2 * CHUNKS * per_chunk + 1
    kv_cache_config, caches = _vllm_sparse_caches(fmt, layout, block, num_blocks)
    _fill(caches)
    cfg = StoreConfig.parse({"copy_path": copy_path, "local": {"socket": pool.socket, "start": "never"}})
    worker = PoolWorker(_mla_config(block), kv_cache_config, cfg, "kv_both")
    worker.register_kv_caches(caches)
    assert len(worker.ctx.groups) == 2 and len(worker.order) == 2 * LAYERS
    assert [ks.shard for ks in worker.keyspaces] == ["tpall"]  # once for all TP ranks
    _round_trip(worker, caches, 2, per_chunk, num_blocks)


def test_int8_codec_refuses_an_fp8_ds_mla_cache_naming_the_layer(pool):
    kv_cache_config, caches = _vllm_sparse_caches("fp8_ds_mla", KVCacheLayout.LBHNC, 64, 9)
    cfg = StoreConfig.parse({"codec": "int8", "local": {"socket": pool.socket, "start": "never"}})
    worker = PoolWorker(_mla_config(64), kv_cache_config, cfg, "kv_both")
    layer = r"model\.layers\.0\.self_attn\.attn"
    with pytest.raises(ValueError, match=rf"cannot store {layer}:.*already quantized"):
        worker.register_kv_caches(caches)
    worker.shutdown()


# vllm-ascend's sparse-attention tuples (vllm_ascend/worker/model_runner_v1.py): the main cache
# [blocks, block, kv heads, dim] (SFA C8 packs the latent, RoPE and scales into one C8 k);
# the indexer's keys [blocks * replicas, block, kv heads, index_head_dim] and, with LI C8,
# their scales [..., 1]. C8: int8 with fp16 scales, fp8 e4m3 with fp32 scales on A5.
ASCEND_BLOCK, LORA, ROPE, INDEX, PACKED = 128, 512, 64, 128, 656
C8 = {"a2": (torch.int8, torch.float16), "a5": (torch.float8_e4m3fn, torch.float32)}


def _ascend_tuple(variant: str, c8: str, num_blocks: int, replicas: int = 1) -> tuple:
    k8, s8 = C8[c8]
    main = {"k": ((LORA,), torch.bfloat16), "v": ((ROPE,), torch.bfloat16), "k_c8": ((PACKED,), k8)}
    index = {"dsa_k": ((INDEX,), torch.bfloat16), "dsa_k_c8": ((INDEX,), k8), "dsa_k_scale": ((1,), s8)}
    out = []
    for part in variant.split("+"):
        (dim,), dtype = main.get(part) or index[part]
        rows = num_blocks * (replicas if part in index else 1)
        out.append(torch.empty(rows, ASCEND_BLOCK, 1, dim, dtype=dtype))
    return tuple(out)


ASCEND_VARIANTS = ["k+v+dsa_k", "k+v+dsa_k_c8+dsa_k_scale", "k_c8+dsa_k", "k_c8+dsa_k_c8+dsa_k_scale", "k_c8"]


@pytest.mark.parametrize("copy_path", ["per_block", "batched"])
@pytest.mark.parametrize("c8", ["a2", "a5"])
@pytest.mark.parametrize("variant", ASCEND_VARIANTS)
def test_vllm_ascend_sparse_tuples_round_trip(pool, variant, c8, copy_path):
    per_chunk = 256 // ASCEND_BLOCK
    num_blocks = 2 * CHUNKS * per_chunk + 1
    vllm_config, kv_cache_config = fake_vllm(LAYERS, ASCEND_BLOCK)
    vllm_config.model_config.use_mla = True
    kv_cache_config.num_blocks = num_blocks
    names = kv_cache_config.kv_cache_groups[0].layer_names
    caches = {n: _ascend_tuple(variant, c8, num_blocks) for n in names}
    _fill(caches)
    cfg = StoreConfig.parse({"copy_path": copy_path, "local": {"socket": pool.socket, "start": "never"}})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    worker.register_kv_caches(caches)
    parts = len(variant.split("+"))
    assert len(worker.ctx.groups) == 1 and len(worker.order) == parts * LAYERS  # main and indexer: one object
    _round_trip(worker, caches, 1, per_chunk, num_blocks)


def test_a_replicated_indexer_cache_stops_the_engine_naming_layer_and_shape(pool):
    vllm_config, kv_cache_config = fake_vllm(LAYERS, ASCEND_BLOCK)
    vllm_config.model_config.use_mla = True
    kv_cache_config.num_blocks = 5
    caches = {n: _ascend_tuple("k+v+dsa_k", "a2", 5, replicas=2)
              for n in kv_cache_config.kv_cache_groups[0].layer_names}
    worker = PoolWorker(vllm_config, kv_cache_config,
                        StoreConfig.parse({"local": {"socket": pool.socket, "start": "never"}}), "kv_both")
    with pytest.raises(ValueError, match=r"cannot store KV cache model\.layers\.0\.self_attn\.attn#2: .*"
                                         r"\(10, 128, 1, 128\).*num_blocks \* 2"):
        worker.register_kv_caches(caches)
    worker.shutdown()


def test_context_parallelism_is_refused_before_the_model_loads():
    from ascend_store.common.config import ConfigError
    from ascend_store.ops.plugin import check_engine_args

    kv = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both"}
    with pytest.raises(ConfigError, match="decode_context_parallel_size=2"):
        check_engine_args(kv, dcp=2)
    with pytest.raises(ConfigError, match="prefill_context_parallel_size=2"):
        check_engine_args(kv, pcp=2)


def test_the_c8_settings_are_part_of_the_namespace():
    from ascend_store.common.keys import cache_format

    vllm_config = _mla_config(ASCEND_BLOCK)
    assert cache_format(vllm_config) == ""
    vllm_config.additional_config = {"enable_sparse_li_c8": True}
    assert cache_format(vllm_config) == "enable_sparse_li_c8"
