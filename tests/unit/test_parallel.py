"""Which shard of a chunk's KV each rank stores (parallel.py): shards, layer spans, the
fallbacks that keep per-TP / per-stage objects, namespaces, head-slice views."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ascend_store.config import ConfigError
from ascend_store.keys import identity_from_vllm
from ascend_store.parallel import head_slices, sharding


def _parallel(tp: int, pp: int = 1, mla: bool = False, kv_heads: int = 8):
    return SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype="bfloat16", use_mla=mla,
                                     get_total_num_kv_heads=lambda: kv_heads),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        device_config=SimpleNamespace(device_type="cpu"))


def test_layer_spans_follow_the_pipeline_split(caplog):
    """Layer spans: a stage holds the spans inside its layers; a split that cuts a span, or
    a model of several KV cache groups, keeps per-stage objects and says why."""
    cfg = _parallel(1, pp=2)
    cfg.model_config.get_total_num_hidden_layers = lambda: 8
    s = sharding(cfg, 0, False, 4)
    assert s.spans(0) == ["L0-1", "L2-3"] and s.spans(1) == ["L4-5", "L6-7"]
    assert sharding(_parallel(1), 0, False).all_spans() == ["pp0of1"]
    assert sharding(cfg, 0, False, 4, single_group=False).all_spans() == ["pp0of2", "pp1of2"]
    assert "several KV cache groups" in caplog.text
    cfg.model_config.get_total_num_hidden_layers = lambda: 6
    assert sharding(cfg, 0, False, 6).layer_slices == 6  # stages of 3 layers, spans of 1
    assert sharding(cfg, 0, False, 3).layer_slices == 0  # spans of 2 layers; stage 1 starts at 3
    assert "span boundary" in caplog.text


def test_shards_name_every_rank_once():
    """What a hit needs per stage: every TP shard; MLA one; head slices every slice, each
    rank owning a contiguous run of them."""
    assert sharding(_parallel(2), 0, False).all_shards() == ["tp0of2", "tp1of2"]
    assert sharding(_parallel(2, mla=True), 4, False).all_shards() == ["tpall"]
    s = sharding(_parallel(2), 4, False)
    assert s.all_shards() == ["h0of4", "h1of4", "h2of4", "h3of4"]
    assert s.shards(1) == ["h2of4", "h3of4"]
    assert sharding(_parallel(4), 4, False).shards(3) == ["h3of4"]


def test_head_slices_fall_back_where_they_cannot_be_shared(caplog):
    """Slices must be at most one rank's heads and split the heads evenly; hybrid models
    keep per-TP objects. Each case says why at start."""
    for cfg, slices, state, why in [(_parallel(8, kv_heads=4), 4, False, "replicates"),
                                    (_parallel(2), 3, False, "do not split"),
                                    (_parallel(4), 2, False, "does not divide"),
                                    (_parallel(2), 4, True, "hybrid")]:
        caplog.clear()
        assert sharding(cfg, slices, state).slices == 0
        assert why in caplog.text


def test_namespaces_across_tp_sizes():
    """MLA and head-sliced namespaces have no TP size: engines of any TP size share them;
    per-TP objects' namespaces name it."""
    def ns(tp: int, slices: int = 0, mla: bool = False) -> str:
        cfg = _parallel(tp, mla=mla)
        return identity_from_vllm(cfg, 16, "raw", sharding(cfg, slices, False)).namespace()

    assert ns(1, mla=True) == ns(2, mla=True)
    assert ns(1, 4) == ns(2, 4) == ns(4, 4)
    assert ns(1) != ns(2)
    assert ns(2, 4) != ns(2, 8) != ns(2)  # the slice count is part of the layout


def test_head_slices_are_views_of_whole_heads():
    """vLLM CPU's [blocks, heads, tokens, 2 x head size]: slice j is heads [j h, (j+1) h)
    of every block, a run of bytes per page; heads inside tokens are refused."""
    cache = torch.arange(5 * 4 * 2 * 6, dtype=torch.float32).reshape(5, 4, 2, 6)
    views = head_slices(cache, 5, 4, 2)
    assert [v.data_ptr() - cache.data_ptr() for v in views] == [0, 2 * 2 * 6 * 4]
    assert torch.equal(views[1][3], cache[3, 2:4])
    flash = torch.zeros(2, 5, 2, 4, 6)  # [K/V, blocks, tokens, heads, head size]
    with pytest.raises(ConfigError, match="heads outermost"):
        head_slices(flash, 5, 4, 2)
