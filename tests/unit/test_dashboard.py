"""deploy/grafana/ascend-store.json charts every metric the connector exports, and only
metrics that exist (tests/e2e/test_server.py checks them on a real engine's /metrics)."""

from __future__ import annotations

import json
import os
import re

from ascend_store.ops.stats import COUNTERS, GAUGES, SECONDS

DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "..", "deploy", "grafana", "ascend-store.json")
_METRIC = re.compile(r"\b(vllm:[a-z_]+)")


def dashboard_metrics(path: str = DASHBOARD) -> dict[str, set[str]]:
    """Panel title -> the metric names its queries use."""
    dash = json.load(open(path))
    return {p["title"]: {name for t in p["targets"] for name in _METRIC.findall(t["expr"])}
            for p in dash["panels"] if p["type"] != "row"}


def exported() -> set[str]:
    return ({f"vllm:ascend_store_{n}_total" for n in (*COUNTERS, *SECONDS)}
            | {f"vllm:ascend_store_{n}" for n in GAUGES})


def test_every_exported_metric_has_a_panel():
    used = set().union(*dashboard_metrics().values())
    assert exported() - used == set()


def test_every_panel_queries_a_metric_and_ascend_store_names_exist():
    for title, names in dashboard_metrics().items():
        assert names, title
        unknown = {n for n in names if n.startswith("vllm:ascend_store_")} - exported()
        assert not unknown, (title, unknown)


def test_panels_have_unique_ids_and_use_the_datasource_variable():
    dash = json.load(open(DASHBOARD))
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
            assert all('model_name=~"$model_name"' in t["expr"] for t in p["targets"]), p["title"]
