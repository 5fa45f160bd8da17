"""Which KV cache groups the connector accepts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_only_full_attention_groups_are_accepted():
    """Hybrid (Mamba/GDN) and sliding-window groups stop the engine at start, by name."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from ascend_store.config import ConfigError
    from ascend_store.layers import check_supported

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    group = lambda spec: SimpleNamespace(kv_cache_spec=spec, layer_names=["model.layers.0.attn"])  # noqa: E731
    check_supported(SimpleNamespace(kv_cache_groups=[group(full)]))
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.bfloat16,))
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                            sliding_window=128)
    for bad, name in ((mamba, "MambaSpec"), (swa, "SlidingWindowSpec")):
        with pytest.raises(ConfigError, match=f"group 1 is {name}.*docs/hybrid.md"):
            check_supported(SimpleNamespace(kv_cache_groups=[group(full), group(bad)]))
