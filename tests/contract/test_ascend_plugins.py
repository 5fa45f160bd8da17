"""The cache layouts of the two Ascend plugins this pool must carry, from their real
layout code (pure-Python wheels, imported from the downloaded wheel files; installing
them would register vLLM plugins). docs/ascend.md describes what these show; the pool
round trips of these layouts belong to the worker's tuple-cache tests."""

from __future__ import annotations

import ast
import inspect
import sys
import types

import pytest
import torch

from ascend_store.common.config import ConfigError
from ascend_store.common.keys import ENGINE_SCALED_KV_DTYPE, identity_from_vllm
from tests.contract.conftest import REPO, distributions

INT8_BACKEND = "vllm_ascend_quantized_kv_cache/methods/int8_dynamic/attention_backend.py"
INT8_SELECT = "vllm_ascend_quantized_kv_cache/adapters/vllm_ascend_hust/backend.py"


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
    torch.manual_seed(0)
    key = torch.randn(40, heads, dim, dtype=torch.bfloat16)
    scales = sem.calc_scales(key, key)
    # One scale per (head, channel), from the first prefill's amax: in the key's dtype, not
    # in the paged cache, so a pool object of int8 pages needs the scales it was made with.
    assert scales.k_inv_scale.shape == (1, heads, dim) and scales.k_inv_scale.dtype == torch.bfloat16
    assert scales.k_aq_scale.shape == (1, heads, 1, dim)
    q = sem.quantize(key, scales.k_inv_scale, scales.k_offset)
    assert q.dtype == torch.int8 and q.shape == key.shape
    back = sem.dequantize(q, scales.k_inv_scale, scales.k_offset, torch.float32)
    # Within about one quantization step of each value's own channel: the step rounded
    # to bf16 adds up to ~0.1 step at the int8 extremes (1.10 at most over 2,000 seeds;
    # the bound against the largest channel's step alone failed for 2% of them).
    assert ((back - key.float()).abs() * scales.k_inv_scale.float()).max() <= 1.25


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


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"{name} not found once"
    return found[0]


def test_int8_plugin_scales_are_per_engine_layer_state_so_the_connector_refuses_it():
    """Where the INT8 plugin keeps its scales, from its real source (its attention backend
    imports vllm_ascend, so it is read, not imported): ``_prepare_int8_scales`` returns
    at once when ``layer._int8_scales_ready``, else sets ``layer._int8_{k,v}_inv_scale`` /
    ``_offset`` from this forward's key/value amax and marks the layer ready. So the scales
    are attributes of each attention layer, computed once per engine from its first
    prefill: not model constants, and not per-block data in the paged cache (which stays
    the (key_cache, value_cache) pair of int8 pages). Like vLLM's calculate_kv_scales, the
    connector refuses that dtype at start. If the plugin moves its scales (into the cache,
    or to checkpoint constants), this fails and the decision is to be revisited."""
    [dist] = distributions("vllm_ascend_quantized_kv_cache-*.whl")
    tree = dist.tree(INT8_BACKEND)
    prepare = _function(tree, "_prepare_int8_scales")
    guard = prepare.body[0]
    assert isinstance(guard, ast.If) and isinstance(guard.body[0], ast.Return), \
        f"{INT8_BACKEND}:{prepare.lineno}: scales no longer computed once per layer"
    assert ast.unparse(guard.test) == "getattr(layer, '_int8_scales_ready', False)"
    set_on_layer = {t.attr for n in ast.walk(prepare) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "layer"}
    assert {"_int8_k_inv_scale", "_int8_v_inv_scale", "_int8_k_offset", "_int8_v_offset",
            "_int8_scales_ready"} <= set_on_layer
    body = ast.unparse(prepare)
    assert "key.abs().amax(dim=0, keepdim=True)" in body and "value.abs().amax(dim=0, keepdim=True)" in body
    # The paged cache the connector is handed: two parts, K and V; nothing else is written to it.
    forward = ast.unparse(_function(tree, "forward"))
    assert "self.key_cache, self.value_cache = (kv_cache[0], kv_cache[1])" in forward
    assert "scale" not in "".join(ast.unparse(t) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                                  for t in n.targets if "cache" in ast.unparse(t))
    # The plugin is selected by exactly the dtype the connector refuses.
    select = _function(dist.tree(INT8_SELECT), "_require_int8_cache_dtype")
    [cmp] = [n for n in ast.walk(select) if isinstance(n, ast.Compare)]
    assert ast.unparse(cmp) == f"cache_dtype != {ENGINE_SCALED_KV_DTYPE!r}"
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model="m", revision=None, dtype="bfloat16"),
        cache_config=types.SimpleNamespace(block_size=128, cache_dtype=ENGINE_SCALED_KV_DTYPE),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=types.SimpleNamespace(device_type="npu"))
    with pytest.raises(ConfigError, match="vllm-ascend-quantized-kv-cache"):
        identity_from_vllm(cfg, 256)


def _step(new=(), cached=(), resumed=(), tokens=None, blocks=None):
    """The parts of vLLM's SchedulerOutput the connector's scheduler half reads."""
    blocks = blocks or {}
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, block_ids=(blocks[r],), num_computed_tokens=0)
                            for r in new],
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=list(cached), resumed_req_ids=set(resumed), num_computed_tokens=[0] * len(cached),
            new_block_ids=[(blocks[r],) if r in blocks else None for r in cached]),
        num_scheduled_tokens=tokens or {}, total_num_scheduled_tokens=sum((tokens or {}).values()),
        finished_req_ids=set(), preempted_req_ids=set())


def test_triattention_plan_marks_a_request_the_scheduler_never_publishes_again(plugins):
    """The TriAttention plugin's own mark of a compacted request, from its real scheduler
    code (stateful.py imports on CPU): ``SchedulerCompressionState.after_schedule`` plans a
    compaction once a request's prompt is computed and attaches the plans, by request id,
    to that step's scheduler output (``transaction.PLAN_ATTRIBUTE``). The connector reads
    them at the next step; from then on it publishes nothing of that request, here its
    re-save after a preemption, while another request is unaffected. The plugin state is
    made without its __init__ (which needs a whole vLLM scheduler) and given stand-ins of
    the scheduler's block manager: the plan itself is the plugin's code."""
    from vllm_ascend_kvcompress import stateful
    from vllm_ascend_kvcompress.transaction import PLAN_ATTRIBUTE

    from ascend_store.common.config import StoreConfig
    from ascend_store.scheduler.compaction import KVCOMPRESS_PLANS
    from ascend_store.scheduler.pool_scheduler import PoolScheduler

    assert PLAN_ATTRIBUTE == KVCOMPRESS_PLANS
    # 0.10.0 refuses to start with any KV connector at all (scheduler and worker side).
    assert 'reasons.append("KV transfer is unsupported")' in inspect.getsource(
        stateful.SchedulerCompressionState._validate_host)

    sys.path.insert(0, str(REPO / "benchmarks"))
    from lookup import _request, fake_vllm

    prompt = 768  # three chunks of 256 tokens, 48 blocks of 16
    vllm_config, kv_cache_config = fake_vllm(2, 16)
    sched = PoolScheduler(vllm_config, kv_cache_config, StoreConfig.parse({}), "kv_producer")
    reqs = {r: _request(r, [i + 7 * n for i in range(prompt)]) for n, r in enumerate("ab")}
    blocks = {r: list(range(1 + 48 * n, 49 + 48 * n)) for n, r in enumerate("ab")}
    for req in reqs.values():
        sched.get_num_new_matched_tokens(req, 0)
    step1 = _step(new="ab", tokens={"a": prompt, "b": prompt}, blocks=blocks)
    saved = sched.build_connector_meta(step1).saves
    assert sorted(s.req_id for s in saved) == ["a"] * 3 + ["b"] * 3  # full prompt KV, before any plan

    # The plugin's scheduler state after vLLM's schedule(): "a" may be compacted, "b"
    # asks for fewer output tokens than the plugin compresses for.
    free = iter(range(200, 300))
    manager = types.SimpleNamespace(req_to_blocks={r: [types.SimpleNamespace(block_id=b) for b in ids]
                                                   for r, ids in blocks.items()})
    host = types.SimpleNamespace(
        kv_cache_manager=types.SimpleNamespace(
            coordinator=types.SimpleNamespace(single_type_managers=[manager]),
            block_pool=types.SimpleNamespace(get_num_free_blocks=lambda: 100, get_new_blocks=lambda n: [
                types.SimpleNamespace(block_id=next(free)) for _ in range(n)])),
        requests={r: types.SimpleNamespace(max_tokens=64 if r == "a" else 1, num_computed_tokens=prompt,
                                           num_prompt_tokens=prompt) for r in "ab"},
        vllm_config=types.SimpleNamespace(speculative_config=None))
    state = object.__new__(stateful.SchedulerCompressionState)
    state.__dict__.update(scheduler=host, pending={}, active={}, attention_group_index=0, threshold=512,
                          budget=256, min_output_tokens=16, scheduler_block_size=16, async_scheduling=False)
    state.after_schedule(step1)
    assert list(getattr(step1, PLAN_ATTRIBUTE)) == ["a"]

    assert sched.build_connector_meta(_step(cached="ab", tokens={"a": 1, "b": 1})).saves == []
    # Both preempted and resumed: vLLM asks the connector again and recomputes the prompts.
    blocks = {r: [b + 100 for b in ids] for r, ids in blocks.items()}
    for req in reqs.values():
        sched.get_num_new_matched_tokens(req, 0)
    resumed = sched.build_connector_meta(_step(cached="ab", resumed="ab", tokens={"a": prompt, "b": prompt},
                                               blocks=blocks)).saves
    assert [s.req_id for s in resumed] == ["b"] * 3  # "a" never again
    assert sched.counters.total["compacted_skips"] == 2
