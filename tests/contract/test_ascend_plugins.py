"""The cache layouts of the two Ascend plugins this pool must carry, from their real
layout code (pure-Python wheels, imported from the downloaded wheel files; installing
them would register vLLM plugins). docs/ascend.md describes what these show; the pool
round trips of these layouts belong to the worker's tuple-cache tests."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.contract.conftest import distributions


@pytest.fixture(scope="module")
def plugins():
    paths = [str(d.path) for d in distributions("vllm_ascend_quantized_kv_cache-*.whl")
             + distributions("vllm_ascend_kvcompress_hust-*.whl")]
    sys.path[:0] = paths
    yield
    for p in paths:
        sys.path.remove(p)


def test_int8_plugin_stores_int8_pages_and_keeps_scales_on_the_layer(plugins):
    from vllm_ascend_quantized_kv_cache.dtypes import resolve_layout
    from vllm_ascend_quantized_kv_cache.methods.int8_dynamic.semantics import Int8DynamicSemantics

    heads, dim = 2, 64
    layout = resolve_layout("int8", dim)
    assert (layout.storage_dtype, layout.packed_last_dim) == ("int8", dim)  # unpacked, one byte per value
    sem = Int8DynamicSemantics(types.SimpleNamespace(num_kv_heads=heads, head_size=dim))
    key = torch.randn(40, heads, dim, dtype=torch.bfloat16)
    scales = sem.calc_scales(key, key)
    # One scale per (head, channel), from the first prefill's amax: in the key's dtype, not
    # in the paged cache, so a pool object of int8 pages needs the scales it was made with.
    assert scales.k_inv_scale.shape == (1, heads, dim) and scales.k_inv_scale.dtype == torch.bfloat16
    assert scales.k_aq_scale.shape == (1, heads, 1, dim)
    q = sem.quantize(key, scales.k_inv_scale, scales.k_offset)
    assert q.dtype == torch.int8 and q.shape == key.shape
    back = sem.dequantize(q, scales.k_inv_scale, scales.k_offset, torch.float32)
    assert (back - key.float()).abs().max() <= (1 / scales.k_inv_scale.float()).max()


def test_triattention_compacts_selected_tokens_into_other_blocks(plugins):
    from vllm_ascend_kvcompress.methods.triattention.cache import materialize_selected_tokens

    blocks, block, heads, dim = 8, 4, 2, 8
    k = torch.randn(blocks, block, heads, dim)
    v = torch.randn(blocks, block, heads, dim)
    before_k = k.clone()
    src, dst = torch.tensor([1, 2, 3]), torch.tensor([6, 7])
    keep = torch.tensor([0, 2, 5, 6, 9])  # logical tokens kept, packed densely into dst
    materialize_selected_tokens(k, v, src, dst, keep, block)
    flat_src = before_k[src].reshape(-1, heads, dim)
    assert torch.equal(k[dst].reshape(-1, heads, dim)[:5], flat_src[keep])
    # The request's blocks now hold a token subset: its KV no longer matches the prefix
    # its token ids hash to, which is why the plugin withholds prefix hashes from it.
    assert not torch.equal(k[dst].reshape(-1, heads, dim)[:5], flat_src[:5])
