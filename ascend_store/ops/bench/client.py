"""Send a workload's requests to an OpenAI-compatible server, one at a time.

Each request streams, so the first chunk carrying output marks its TTFT. The pool's share
of its prompt is the change of ``vllm:external_prefix_cache_hits_total`` on the server's
``/metrics`` across the request (requests run alone, so the change is theirs); a server
without that counter reports no pool tokens. Standard library only.
"""

from __future__ import annotations

import http.client
import json
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TextIO

from ascend_store.ops.bench.workloads import Request, Workload

_HITS = re.compile(r"^vllm:external_prefix_cache_hits_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


class BenchError(RuntimeError):
    """The server could not be used; the message says what happened and what to check."""


@dataclass
class Sample:
    phase: str
    prompt_tokens: int | None  # from the server's usage report
    output_tokens: int | None
    pool_tokens: int | None  # None: the server exports no external prefix cache counter
    ttft_ms: float
    latency_ms: float


def _detail(exc: urllib.error.HTTPError) -> str:
    """The server's error message on one line (OpenAI servers send {"error": {"message"}})."""
    body = exc.read().decode(errors="replace")
    try:
        err = json.loads(body).get("error", {})
        body = err.get("message", body) if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        pass
    return " ".join(body.split())[:300] or str(exc.reason)


class Server:
    def __init__(self, url: str, timeout_s: float = 300.0):
        self.base = url.rstrip("/")
        self.timeout_s = timeout_s
        self.model = self._get_json("/v1/models")["data"][0]["id"]

    def _open(self, path: str, body: dict | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            raise BenchError(f"{self.base}{path} answered HTTP {exc.code}: {_detail(exc)}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            raise BenchError(f"cannot reach an OpenAI server at {self.base} ({reason}). Start one, e.g. "
                             "python -m vllm.entrypoints.openai.api_server --model MODEL --port 8000, "
                             "or point --url at it.") from None

    def _get_json(self, path: str) -> dict:
        with self._open(path) as r:
            try:
                out = json.load(r)
                out["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise BenchError(f"{self.base}{path} did not answer like an OpenAI server "
                                 "(expected a JSON model list)") from None
        return out

    def pool_hits(self) -> float | None:
        with self._open("/metrics") as r:
            found = _HITS.findall(r.read().decode(errors="replace"))
        return sum(map(float, found)) if found else None

    def send(self, req: Request) -> tuple[float, float, str, dict]:
        """TTFT ms, latency ms, answer text and the usage report of one streamed request."""
        body = {"model": self.model, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        chat = req.messages is not None
        if chat:
            path, body["messages"] = "/v1/chat/completions", req.messages
        else:
            path, body["prompt"] = "/v1/completions", req.prompt
        t0 = time.perf_counter()
        ttft, parts, usage = None, [], {}
        with self._open(path, body) as r:
            for line in r:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    # A chat stream opens with a role-only chunk before any token: skip it.
                    output = bool(text) or choice.get("finish_reason") if chat else text is not None
                    if ttft is None and output:
                        ttft = time.perf_counter() - t0
                    parts.append(text or "")
        latency = time.perf_counter() - t0
        if ttft is None:
            raise BenchError(f"{self.base}{path} streamed no output for a {req.phase} request")
        return ttft * 1e3, latency * 1e3, "".join(parts), usage


def _progress(out: TextIO, done: int, total: int, label: str) -> None:
    width = 30
    bar = "#" * (done * width // total) + "." * (width - done * width // total)
    out.write(f"\r[{bar}] {done}/{total} {label:<16}")
    if done == total:
        out.write("\n")
    out.flush()


def run(server: Server, workload: Workload, progress: TextIO | None = sys.stderr) -> list[Sample]:
    samples = []
    for req in workload.requests():
        before = server.pool_hits()
        ttft, latency, req.answer, usage = server.send(req)
        after = server.pool_hits()
        pool = None if before is None or after is None else int(after - before)
        samples.append(Sample(req.phase, usage.get("prompt_tokens"), usage.get("completion_tokens"),
                              pool, ttft, latency))
        if progress is not None:
            _progress(progress, len(samples), workload.total, f"{workload.name} {req.phase}")
    return samples
