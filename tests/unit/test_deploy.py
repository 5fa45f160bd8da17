"""Every example kv-transfer-config under deploy/ passes the connector's own validation."""

from __future__ import annotations

import glob
import json
import os
from types import SimpleNamespace

import pytest

from ascend_store.config import check_transfer_config

DEPLOY = os.path.join(os.path.dirname(__file__), "..", "..", "deploy")
CONFIGS = sorted(glob.glob(os.path.join(DEPLOY, "configs", "*.json")))


def _k8s_configs():
    yaml = pytest.importorskip("yaml")
    docs = yaml.safe_load_all(open(os.path.join(DEPLOY, "k8s", "vllm-with-pool.yaml")))
    return [json.loads(d["data"]["kv-transfer.json"]) for d in docs if d.get("kind") == "ConfigMap"]


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_example_config_is_valid(path):
    raw = json.load(open(path))
    assert raw["kv_connector"] == "AscendStoreConnector"
    assert raw["kv_connector_module_path"] == "ascend_store.connector"
    fields = {k: raw[k] for k in ("kv_role", "kv_connector_extra_config")}
    cfg = check_transfer_config(SimpleNamespace(**fields))
    assert os.path.basename(path).startswith(cfg.backend + "-")
    assert raw["kv_role"] in os.path.basename(path)


def test_every_role_has_an_example():
    assert {json.load(open(p))["kv_role"] for p in CONFIGS} == {"kv_both", "kv_producer", "kv_consumer"}


def test_k8s_config_is_valid():
    for raw in _k8s_configs():
        check_transfer_config(SimpleNamespace(kv_role=raw["kv_role"],
                                              kv_connector_extra_config=raw["kv_connector_extra_config"]))


def test_mooncake_config_file_is_valid(monkeypatch):
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", os.path.join(DEPLOY, "mooncake", "mooncake.json"))
    cfg = check_transfer_config(SimpleNamespace(kv_role="kv_both",
                                                kv_connector_extra_config={"backend": "mooncake"}))
    assert cfg.mooncake.master == "mooncake-master:50051"
    assert cfg.mooncake.global_segment_size == 0 and cfg.mooncake.staging_size == 2 * 2**30

