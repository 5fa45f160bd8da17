"""Which layers the pool stores, and the stable ids their keys use."""

from __future__ import annotations

from ascend_store.config import ConfigError
from ascend_store.keys import layer_index


def check_supported(kv_cache_config) -> None:
    """Only full-attention KV is stored in this release: refuse anything else at start
    instead of serving a hybrid model without its recurrent state (docs/hybrid.md)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        windowed = type(spec).__name__.startswith("Sliding") or getattr(spec, "sliding_window", None)
        if not isinstance(spec, FullAttentionSpec) or windowed:
            raise ConfigError(
                f"ascend-store: KV cache group {g} is {type(spec).__name__}; this release stores "
                "full-attention KV only (hybrid and sliding-window models are not supported yet, "
                "see docs/hybrid.md)")


def layer_ids(kv_cache_config) -> dict[str, tuple[int, int]]:
    """layer name -> (KV cache group, global layer id), in the model's layer order.

    The id is vLLM's layer number from the module name; if two layers share a number
    (several attention modules in one block) positions are used instead.
    """
    names = [(g, n) for g, grp in enumerate(kv_cache_config.kv_cache_groups) for n in grp.layer_names]
    ids = [layer_index(n, i) for i, (_, n) in enumerate(names)]
    if len(set(ids)) != len(ids):
        ids = list(range(len(names)))
    return {n: (g, i) for (g, n), i in zip(names, ids)}
