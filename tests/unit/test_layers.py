"""Which KV cache groups the connector accepts, and how it classifies them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def _group(spec):
    return SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.attn"])


def test_full_attention_and_align_mode_state_groups_are_accepted():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from ascend_store.common.layers import ATTN, STATE, group_kinds

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,), mamba_cache_mode="align")
    assert group_kinds(SimpleNamespace(kv_cache_groups=[_group(full)])) == [ATTN]
    assert group_kinds(SimpleNamespace(kv_cache_groups=[_group(mamba), _group(full)])) == [STATE, ATTN]


def test_unsupported_groups_stop_the_engine_by_name():
    """Sliding windows, state outside align mode, speculative state blocks and mixed block
    sizes fail at start with the reason and docs/hybrid.md."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from ascend_store.common.config import ConfigError
    from ascend_store.common.layers import group_kinds

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                            sliding_window=128)
    cases = [
        (swa, "group 1 is SlidingWindowSpec.*docs/hybrid.md"),
        (MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,), mamba_cache_mode="none"),
         "mamba_cache_mode='none'.*docs/hybrid.md"),
        (MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,), mamba_cache_mode="all"),
         "mamba_cache_mode='all'"),
        (MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,), mamba_cache_mode="align",
                   num_speculative_blocks=1), "speculative"),
        (MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.bfloat16,), mamba_cache_mode="align"),
         "different block sizes"),
    ]
    for bad, match in cases:
        with pytest.raises(ConfigError, match=match):
            group_kinds(SimpleNamespace(kv_cache_groups=[_group(full), _group(bad)]))


def test_vllm_zeroes_new_blocks_of_hybrid_models_so_their_loads_start_late():
    """vLLM zeroes a hybrid model's new blocks after handle_preemptions: its loads must
    not start there (PoolWorker.starts_early), or the zeroing could land after them."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    from ascend_store.worker.pool_worker import zeroes_new_blocks

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,), mamba_cache_mode="align")
    dense = KVCacheConfig(8, [], [KVCacheGroupSpec(["model.layers.0.attn"], full)])
    hybrid = KVCacheConfig(8, [], [KVCacheGroupSpec(["model.layers.0.linear_attn"], mamba),
                                   KVCacheGroupSpec(["model.layers.1.attn"], full)])
    assert not zeroes_new_blocks(dense)
    assert zeroes_new_blocks(hybrid)
