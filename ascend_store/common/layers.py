"""Which layers the pool stores, and the stable ids their keys use."""

from __future__ import annotations

from ascend_store.common.config import ConfigError
from ascend_store.common.keys import layer_index

ATTN, STATE = "attn", "state"


def group_kinds(kv_cache_config) -> list[str]:
    """Per KV cache group: ``attn`` (paged KV) or ``state`` (a linear-attention layer's
    recurrent state in ``align`` mode). Anything else is refused at start with the reason
    (docs/hybrid.md lists what is supported)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    kinds = []
    block_sizes = set()
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        name = type(spec).__name__
        block_sizes.add(spec.block_size)
        if isinstance(spec, MambaSpec):
            mode = getattr(spec, "mamba_cache_mode", None)
            if mode != "align":
                raise ConfigError(
                    f"ascend-store: KV cache group {g} ({name}) uses mamba_cache_mode={mode!r}; the "
                    "pool stores recurrent state only in 'align' mode (enable prefix caching and "
                    "leave mamba_cache_mode at its default, see docs/hybrid.md)")
            if getattr(spec, "num_speculative_blocks", 0):
                raise ConfigError(f"ascend-store: KV cache group {g} ({name}) has speculative state "
                                  "blocks; hybrid models with speculative decoding are not supported")
            kinds.append(STATE)
            continue
        windowed = name.startswith("Sliding") or getattr(spec, "sliding_window", None)
        if not isinstance(spec, FullAttentionSpec) or windowed:
            raise ConfigError(
                f"ascend-store: KV cache group {g} is {name}; the pool stores full-attention KV "
                "and align-mode linear-attention state only (sliding-window and other layer "
                "types are not supported, see docs/hybrid.md)")
        kinds.append(ATTN)
    if len(block_sizes) > 1:
        raise ConfigError(f"ascend-store: KV cache groups have different block sizes {sorted(block_sizes)}")
    return kinds


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
