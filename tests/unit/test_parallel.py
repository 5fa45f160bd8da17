"""Which shard of a chunk's KV each rank stores (parallel.py): shards, layer spans, the
fallbacks that keep per-TP / per-stage objects, namespaces, head-slice views."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ascend_store.common.config import ConfigError
from ascend_store.common.keys import identity_from_vllm
from ascend_store.common.parallel import head_slices, sharding


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
    """Slice j is heads [j h, (j+1) h) of every block: vLLM CPU's [blocks, heads, tokens,
    2 x head size] (one run of bytes per page), FlashAttention's [2, blocks, tokens, heads,
    head size] and a tuple cache's K or V [blocks, tokens, heads, head size] (a run per
    token); a page where the heads cannot be told apart is refused."""
    cache = torch.arange(5 * 4 * 2 * 6, dtype=torch.float32).reshape(5, 4, 2, 6)
    views = head_slices(cache, 5, (4, 2, 3), 2)
    assert [v.data_ptr() - cache.data_ptr() for v in views] == [0, 2 * 2 * 6 * 4]
    assert torch.equal(views[1][3], cache[3, 2:4])
    flash = torch.randn(2, 5, 2, 4, 6)  # [K/V, blocks, tokens, heads, head size]
    views = head_slices(flash, 5, (4, 2, 6), 2)
    assert torch.equal(views[1], flash[:, :, :, 2:4]) and views[1].data_ptr() == flash[:, :, :, 2:].data_ptr()
    k = torch.randn(5, 2, 4, 6)  # vllm-ascend's K: [blocks, tokens, heads, head size]
    assert torch.equal(head_slices(k, 5, (4, 2, 6), 4)[3], k[:, :, 3:4])
    with pytest.raises(ConfigError, match="KV heads dimension"):
        head_slices(torch.zeros(5, 4, 4, 6).transpose(1, 2), 5, (4, 4, 5), 2)


N, BLOCK, HEADS, LAYERS = 9, 16, 4, 4


def _worker(pool, monkeypatch, tp: int, rank: int, copy_path: str = "auto"):
    """A worker of rank ``rank`` of a TP-``tp`` engine, with 4 head slices and 2 layer spans
    of a 4-layer model of 4 KV heads (a real local pool; ranks are set, not spawned)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from ascend_store.common.config import StoreConfig
    from ascend_store.worker import pool_worker

    monkeypatch.setattr(pool_worker, "_ranks", lambda: (rank, 0))
    cfg = _parallel(tp, kv_heads=HEADS)
    cfg.model_config.get_total_num_hidden_layers = lambda: LAYERS
    cfg.cache_config.block_size = BLOCK
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS // tp, head_size=8, dtype=torch.float32)
    store = StoreConfig.parse({"head_slices": 4, "layer_slices": 2, "chunk_size": 0, "copy_path": copy_path,
                               "local": {"socket": pool.socket, "start": "never"}})
    kv_cache_config = KVCacheConfig(N, [], [KVCacheGroupSpec(names, spec)])
    return pool_worker.PoolWorker(cfg, kv_cache_config, store, "kv_both")


def _save(worker, caches, blocks, chunk):
    from ascend_store.common.metadata import ChunkSave, StepMetadata

    meta = StepMetadata(saves=[ChunkSave("r", 0, f"{chunk + i:032x}", [b]) for i, b in enumerate(blocks)],
                        commit_now=True)  # published when wait_for_save returns
    for name in caches:
        worker.save_kv_layer(name, meta)
    worker.wait_for_save(meta)


def _load(worker, caches, blocks, chunk):
    from ascend_store.common.metadata import ChunkLoad, StepMetadata

    meta = StepMetadata(loads=[ChunkLoad("r", 0, f"{chunk + i:032x}", [b]) for i, b in enumerate(blocks)])
    worker.handle_preemptions(meta)
    worker.start_load_kv(meta)
    for name in caches:
        worker.wait_for_layer_load(name)
    assert worker.get_block_ids_with_load_errors() == set()


# Cache layouts of a layer with ``h`` KV heads of size 8 (blocks of 16 tokens), and where a
# rank's heads [a, b) and block ids sit in each: (make, heads of, blocks of).
LAYOUTS = {
    "cpu": (lambda h, g: torch.randn(N, h, BLOCK, 16, generator=g),  # vLLM CPU
            lambda t, a, b: t[:, a:b], lambda t, ids: t[ids]),
    "flash": (lambda h, g: torch.randn(2, N, BLOCK, h, 8, generator=g),  # FlashAttention
              lambda t, a, b: t[:, :, :, a:b], lambda t, ids: t[:, ids]),
    "tuple": (lambda h, g: tuple(torch.randn(N, BLOCK, h, 8, generator=g) for _ in range(2)),  # vllm-ascend
              lambda t, a, b: tuple(x[:, :, a:b] for x in t),
              lambda t, ids: torch.stack([x[ids] for x in t])),
}


def _clone(cache):
    return tuple(x.clone() for x in cache) if isinstance(cache, tuple) else cache.clone()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("copy_path", ["per_block", "batched"])
def test_head_slices_shared_between_tp_sizes(pool, monkeypatch, layout, copy_path):
    """A TP=1 engine's objects load into each TP=2 rank's half of the heads, and the two
    ranks' objects into a TP=1 engine, byte-exact; each rank touches only the slices of its
    heads (no missing object). In every cache layout (heads outermost in a page, or inside
    tokens, or a tuple of K and V) and on both copy paths (the batched one runs the plan the
    GPU kernel runs, one segment per run of a slice's bytes)."""
    make, heads_of, blocks_of = LAYOUTS[layout]
    g = torch.Generator().manual_seed(0)
    other = torch.Generator().manual_seed(1)  # what the caches hold before a load overwrites it
    full = {f"model.layers.{i}.self_attn.attn": make(HEADS, g) for i in range(LAYERS)}
    one = _worker(pool, monkeypatch, 1, 0, copy_path)
    one.register_kv_caches(full)
    assert len(one.ctx.groups) == 4 * 2  # 4 head slices x 2 layer spans
    _save(one, full, [1, 2], chunk=0)
    for rank in (0, 1):
        half = {n: make(HEADS // 2, other) for n in full}
        w = _worker(pool, monkeypatch, 2, rank, copy_path)
        w.register_kv_caches(half)
        _load(w, half, [5, 6], chunk=0)
        for n, t in half.items():
            mine = heads_of(full[n], 2 * rank, 2 * rank + 2)
            assert torch.equal(blocks_of(t, [5, 6]), blocks_of(mine, [1, 2])), (rank, n)
        w.shutdown()
        half = {n: _clone(heads_of(full[n], 2 * rank, 2 * rank + 2)) for n in full}
        w = _worker(pool, monkeypatch, 2, rank, copy_path)
        w.register_kv_caches(half)
        _save(w, half, [3], chunk=100)  # each rank writes its heads of chunk 100
        assert w.counters.total["saved_objects"] == 2 * 2  # 2 slices x 2 spans
        w.shutdown()
    target = {n: make(HEADS, other) for n in full}
    one.shutdown()
    one = _worker(pool, monkeypatch, 1, 0, copy_path)
    one.register_kv_caches(target)
    _load(one, target, [8], chunk=100)
    for n, t in target.items():
        assert torch.equal(blocks_of(t, [8]), blocks_of(full[n], [3])), n
    assert not one.counters.total.get("load_missing")
    one.shutdown()
