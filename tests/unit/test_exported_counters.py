"""Every counter the connector keeps reaches Prometheus. The names come from the package's
source (each ``counters[...]`` it writes or reads), so a counter added anywhere without an
entry in stats.COUNTERS, GAUGES or SECONDS fails here instead of being silently dropped by
``AscendStorePromMetrics.observe``."""

from __future__ import annotations

import ast
import functools
import pathlib
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import ascend_store
from ascend_store.backends.base import Status
from ascend_store.ops import stats

PKG = pathlib.Path(ascend_store.__file__).parent
# The pool process's own counters, shown by `ascend-store pool status`, not by vLLM.
POOL_PROCESS = {"backends/local/index.py", "backends/local/disk.py", "backends/local/tiers.py"}
# Names built at run time ("*": the part only known then) -> every name they can take.
DYNAMIC = {
    "save_skipped_*": {f"save_skipped_{s.name.lower()}" for s in Status if s is not Status.OK},  # saves.py
    "*_rpcs": {f"{d}_rpcs" for d in stats.StepCalls.DIRECTIONS},
    "max_*_rpcs_per_step": {f"max_{d}_rpcs_per_step" for d in stats.StepCalls.DIRECTIONS},
}
COPIED = object()  # a name bound to the keys of another counters dict (scanned where they are counted)


def _is_counters(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "counters" \
        or isinstance(node, ast.Name) and node.id == "counters"


def _bindings(func: ast.AST) -> dict[str, object]:
    """Names a function binds once to a key expression, or to another counters dict's keys."""
    out: dict[str, object] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
        elif isinstance(node, ast.For) and isinstance(node.iter, ast.Call) \
                and isinstance(node.iter.func, ast.Attribute) and _is_counters(node.iter.func.value):
            for t in ast.walk(node.target):
                if isinstance(t, ast.Name):
                    out[t.id] = COPIED
    return out


def _keys(expr: ast.AST, scope: dict[str, object]) -> set[str]:
    """The counter names an index expression can take ("*" for a part known only at run time)."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return {expr.value}
    if isinstance(expr, ast.IfExp):
        return _keys(expr.body, scope) | _keys(expr.orelse, scope)
    if isinstance(expr, ast.JoinedStr):
        return {"".join(v.value if isinstance(v, ast.Constant) else "*" for v in expr.values)}
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add):
        return {a + b for a in _keys(expr.left, scope) for b in _keys(expr.right, scope)}
    if isinstance(expr, ast.Name) and expr.id in scope:
        bound = scope[expr.id]
        return set() if bound is COPIED else _keys(bound, scope)
    return {"*"}


def counted_names() -> dict[str, str]:
    """Every counter name the package counts -> where (file:line)."""
    found: dict[str, str] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel in POOL_PROCESS:
            continue
        tree = ast.parse(path.read_text())
        scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for func in scopes:
            scope = _bindings(func)
            for node in ast.walk(func):
                if isinstance(node, ast.Subscript) and _is_counters(node.value):
                    for name in _keys(node.slice, scope):
                        found.setdefault(name, f"ascend_store/{rel}:{node.lineno}")
    return found


def test_the_scan_sees_literal_conditional_and_built_names():
    found = counted_names()
    assert len(found) > 40, sorted(found)
    assert {"lookups", "loads_before_forward", "cache_hits", "decode_chunks"} <= set(found)
    assert _keys(ast.parse('"a" if x else "b" + s', mode="eval").body, {}) == {"a", "b*"}
    assert set(DYNAMIC) <= set(found), "a name DYNAMIC lists is no longer counted: drop it there"


def test_every_counted_name_is_exported_with_help_text():
    found = counted_names()
    unknown = {n: where for n, where in found.items() if "*" in n and n not in DYNAMIC}
    assert not unknown, f"counter names built at run time: list what they can be in DYNAMIC {unknown}"
    names = {n for n in found if "*" not in n} | set().union(*DYNAMIC.values())
    exported = {**stats.COUNTERS, **stats.GAUGES, **stats.SECONDS}
    missing = sorted(f"{n} ({found.get(n) or 'built'})" for n in names if not exported.get(n))
    assert not missing, f"counted but not exported (add them, with help text, to stats.py): {missing}"

    # What vLLM's Prometheus logger does with a report of every one of them.
    registry = CollectorRegistry()
    types = {t: functools.partial(t, registry=registry) for t in (Counter, Gauge, Histogram)}
    prom = stats.AscendStorePromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["engine"],
                                        {0: ["0"]})
    prom.observe({n: 3 for n in names}, engine_idx=0)
    for n in sorted(names):
        sample = f"vllm:ascend_store_{n}" + ("" if n in stats.GAUGES else "_total")
        assert registry.get_sample_value(sample, {"engine": "0"}) == 3, sample
