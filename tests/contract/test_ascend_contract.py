"""Every name our code calls in torch_npu, vllm-ascend and memcache_hybrid exists there
and takes the arguments we pass, read from the real packages of the index (see
conftest.py): memcache_hybrid imported, torch_npu and vllm-ascend from their Python
sources. The names are read from our own sources too, so renaming a call on either side
fails here. What these cannot show (behaviour on an NPU): docs/ascend.md."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

from tests.contract.conftest import REPO, ascend_store_tree, distributions

# -- helpers ---------------------------------------------------------------------------


def _calls(tree: ast.AST, receiver) -> list[tuple[str, int, set[str], ast.Call]]:
    """(method, positional count, keyword names, node) of calls ``<receiver>.method(...)``,
    where ``receiver(node)`` says whether a call's receiver matches."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and receiver(node.func.value):
            out.append((node.func.attr, len(node.args), {k.arg for k in node.keywords if k.arg}, node))
    return out


def _is_name(name: str):
    return lambda v: isinstance(v, ast.Name) and v.id == name


def _is_attr(owner: str, attr: str):
    return lambda v: (isinstance(v, ast.Attribute) and v.attr == attr and isinstance(v.value, ast.Name)
                      and v.value.id == owner)


def _functions(tree: ast.AST) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def _accepts(fn: ast.FunctionDef, positional: int, keywords: set[str], bound: bool = True) -> bool:
    """Whether a Python function's signature takes ``positional`` arguments (after self
    or cls when ``bound``) and these keywords."""
    a = fn.args
    params = [p.arg for p in a.posonlyargs + a.args][1 if bound else 0:]
    required = len(params) - len(a.defaults)
    if positional > len(params) and a.vararg is None:
        return False
    missing = [p for p in params[positional:required] if p not in keywords]
    known = set(params) | {p.arg for p in a.kwonlyargs}
    return not missing and (a.kwarg is not None or keywords <= known)


# -- torch_npu ---------------------------------------------------------------------------

DEVICE = "ascend_store/device/platform.py"
# Calls on what torch.npu hands back (streams and events), made in device/platform.py and
# device_path.py: (class, method, positional args, keywords).
OBJECT_CALLS = [("Stream", "__new__", 0, {"device"}), ("Event", "__new__", 0, set()),
                ("Event", "record", 1, set()), ("Event", "synchronize", 0, set()),
                ("Stream", "wait_event", 1, set())]


@pytest.fixture(scope="module", params=["torch_npu-*.whl"])
def torch_npu_wheels(request):
    return distributions(request.param)


def test_torch_npu_has_every_name_the_device_layer_calls(torch_npu_wheels):
    ours = _calls(ascend_store_tree(DEVICE), _is_attr("self", "_mod"))
    assert {m for m, *_ in ours} >= {"Stream", "Event", "stream", "current_stream"}
    ours_src = "".join((REPO / f).read_text() for f in (DEVICE, "ascend_store/device/device_path.py"))
    for whl in torch_npu_wheels:
        exported = next(ast.literal_eval(n.value) for n in ast.walk(whl.tree("torch_npu/npu/__init__.py"))
                        if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__all__")
        utils = _functions(whl.tree("torch_npu/npu/utils.py"))
        for name, npos, kws, _ in ours:
            assert name in exported, f"{whl.path.name}: torch.npu.{name} is gone"
            if name in utils:
                assert _accepts(utils[name], npos, kws, bound=False), \
                    f"{whl.path.name}: torch.npu.{name}{npos, kws}"
        classes = {n.name: _functions(n) for n in whl.tree("torch_npu/npu/streams.py").body
                   if isinstance(n, ast.ClassDef)}
        for cls, method, npos, kws in OBJECT_CALLS:
            if method != "__new__":
                assert f".{method}(" in ours_src, f"we no longer call {cls}.{method}: update OBJECT_CALLS"
            assert method in classes[cls], f"{whl.path.name}: torch.npu.{cls}.{method} is gone"
            assert _accepts(classes[cls][method], npos, kws), f"{whl.path.name}: {cls}.{method}{npos, kws}"
        # torch.npu exists (and "npu" is a device type) only because torch_npu registers them.
        backend = whl.source("torch_npu/_init/registry/backend.py")
        assert 'rename_privateuse1_backend("npu")' in backend
        assert '_register_device_module("npu", torch_npu.npu)' in backend


# -- vllm-ascend -------------------------------------------------------------------------

RUNNER = "vllm_ascend/worker/model_runner_v1.py"
ATTENTION = "vllm_ascend/attention/utils.py"


@pytest.fixture(scope="module")
def vllm_ascend():
    return distributions("vllm_ascend-*.tar.gz")[-1]


def test_vllm_ascend_calls_only_hooks_our_connector_has(vllm_ascend):
    from ascend_store.connector import AscendStoreConnector

    def is_group(v):
        return isinstance(v, ast.Call) and getattr(v.func, "id", "") == "get_kv_transfer_group"

    calls = (_calls(vllm_ascend.tree(RUNNER), is_group)
             + _calls(vllm_ascend.tree(ATTENTION), _is_name("connector")))
    assert {m for m, *_ in calls} >= {"register_kv_caches", "handle_preemptions", "save_kv_layer",
                                      "wait_for_layer_load"}
    for method, npos, kws, node in calls:
        fn = getattr(AscendStoreConnector, method, None)
        assert fn is not None, f"vllm-ascend calls connector.{method} (line {node.lineno})"
        inspect.signature(fn).bind(None, *range(npos), **dict.fromkeys(kws))


def test_vllm_ascend_hands_attention_caches_as_tuples_per_layer(vllm_ascend):
    """register_kv_caches gets, per attention layer, (k_cache, v_cache); MLA (nope, rope);
    sparse attention adds the indexer cache (and its scales): never one tensor."""
    shapes = set()
    for node in ast.walk(vllm_ascend.tree(RUNNER)):
        target = node.targets[0] if isinstance(node, ast.Assign) else None
        if (isinstance(target, ast.Subscript) and getattr(target.value, "id", "") == "kv_caches"
                and isinstance(node.value, ast.Tuple)):
            shapes.add(tuple(getattr(e, "id", "?") for e in node.value.elts))
    assert ("k_cache", "v_cache") in shapes
    assert all(s[0] == "k_cache" for s in shapes)
    # The sparse-attention tuples tests/unit/test_sparse_caches.py stores (ASCEND_VARIANTS).
    k, v, dk, ds = "k_cache", "v_cache", "dsa_k_cache", "dsa_k_scale_cache"
    assert shapes >= {(k, v, dk), (k, v, dk, ds), (k, dk), (k, dk, ds), (k,)}


def test_vllm_ascend_sparse_cache_shapes_and_c8_dtypes_are_the_ones_we_store(vllm_ascend):
    """What tests/unit/test_sparse_caches.py builds: the indexer's caches have
    ``num_blocks * sfa_dcp_replicated_indexer_size`` rows, a size other than 1 only under
    decode context parallelism (which the connector refuses); C8 is int8 with fp16 scales,
    fp8 e4m3 with fp32 scales on A5; the indexer's scales have a last dim of 1."""
    src = " ".join(vllm_ascend.source(RUNNER).split())
    spec = "current_kv_cache_spec."
    rows = f"num_blocks * {spec}sfa_dcp_replicated_indexer_size, "
    for fact in (f"dsa_k_cache_shape = ( {rows}{spec}block_size, {spec}num_kv_heads, "
                 "self.model_config.hf_text_config.index_head_dim, )",
                 f"dsa_k_scale_cache_shape = ( {rows}{spec}block_size, {spec}num_kv_heads, 1, )",
                 "self.sfa_dcp_replicated_indexer_size = 1 if enable_sfa_dcp_replicated_indexer(): "
                 "self.sfa_dcp_replicated_indexer_size = self.dcp_size",
                 "self.c8_k_cache_dtype = torch.float8_e4m3fn self.c8_k_scale_cache_dtype = torch.float32 "
                 "else: self.c8_k_cache_dtype = torch.int8 self.c8_k_scale_cache_dtype = torch.float16"):
        assert fact in src, fact
    utils = " ".join(vllm_ascend.source("vllm_ascend/utils.py").split())
    assert "and parallel_config.decode_context_parallel_size > 1" in utils


def test_vllm_ascend_memcache_client_inits_one_device_per_rank(vllm_ascend):
    """The convention our memcache backend follows: ``init(local_rank, init_bm=...)``."""
    src = vllm_ascend.source("vllm_ascend/distributed/kv_transfer/kv_pool/ascend_store/backend/"
                             "memcache_backend.py")
    assert "store.init(self.local_rank, init_bm=self._init_bm)" in src


# -- memcache_hybrid -----------------------------------------------------------------------

MEMCACHE = "ascend_store/backends/memcache.py"


def _pybind_params(doc: str) -> list[tuple[str, bool]]:
    """(name, has default) of a pybind11 method's parameters after self, from its docstring."""
    head = doc.strip().splitlines()[0]
    inner = head[head.index("(") + 1:head.rindex(")")]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        depth += ch in "[(<"
        depth -= ch in "])>"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    params = [(p.split(":")[0].strip(), " = " in p) for p in parts if p.strip()]
    return params[1:] if params and params[0][0] == "self" else params


def _store_calls() -> list[tuple[str, int, set[str]]]:
    """Every DistributedObjectStore call of the memcache backend's client (memcache.py, run in
    its helper process): on ``store`` or ``self.store``."""
    def on_store(v) -> bool:
        return _is_name("store")(v) or _is_attr("self", "store")(v)

    out = []
    for m, n, k, node in _calls(ascend_store_tree(MEMCACHE), on_store):
        n += sum(isinstance(a, ast.Starred) for a in node.args)  # *self._put_args: 2 at most
        out.append((m, n, k))
    return out


def test_memcache_hybrid_has_every_call_our_backend_makes():
    mh = pytest.importorskip("memcache_hybrid")
    calls = _store_calls()
    for method, npos, kws in calls:
        fn = getattr(mh.DistributedObjectStore, method, None)
        assert fn is not None, f"memcache_hybrid.DistributedObjectStore.{method} is gone"
        params = _pybind_params(fn.__doc__)
        names = [p for p, _ in params]
        required = [p for p, has_default in params if not has_default]
        assert npos <= len(params), f"{method}: we pass {npos} positional arguments, it takes {names}"
        assert set(required[npos:]) <= kws and kws <= set(names), f"{method}{npos, kws} vs {names}"
    assert {m for m, *_ in calls} >= {"setup", "init", "register_buffer", "batch_is_exist", "batch_put_from",
                                      "batch_get_into", "remove", "close"}


def test_memcache_hybrid_has_every_config_field_we_set():
    mh = pytest.importorskip("memcache_hybrid")
    tree = ascend_store_tree(MEMCACHE)
    sets = {(t.value.id if isinstance(t.value, ast.Name) else t.value.attr, t.attr)
            for n in ast.walk(tree) if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Attribute)}
    local = mh.LocalConfig()
    for owner, attr in sets:
        if owner == "local":
            assert hasattr(local, attr), f"LocalConfig.{attr} is gone"
        elif owner == "_replicas":
            assert hasattr(mh.ReplicateConfig(), attr), f"ReplicateConfig.{attr} is gone"
    assert {a for o, a in sets if o == "local"} >= {"meta_service_url", "protocol", "dram_size"}
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "memcache_hybrid"}
    assert used and all(hasattr(mh, name) for name in used)
    assert hasattr(mh.KeyInfo, "size")


def test_memcache_protocols_are_memcache_hybrids():
    mh = pytest.importorskip("memcache_hybrid")
    from ascend_store.common.config import MEMCACHE_PROTOCOLS

    documented = set(re.findall(r"\b(?:host|device)_[a-z]+\b", mh.LocalConfig.protocol.__doc__))
    assert set(MEMCACHE_PROTOCOLS) == documented
