"""``ascend-store bench``: a shared-prefix workload against a vLLM OpenAI server.

Each request is sent alone with streaming, so the time to its first streamed token is
its TTFT; the pool's share of its prompt is read from the server's Prometheus counter
``vllm:external_prefix_cache_hits_total`` before and after it. Prints a summary table
and writes a PNG plot of TTFT per request, split into pool hits and misses.
Standard library only, except matplotlib for the plot.
"""

from __future__ import annotations

import json
import random
import re
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass

_HITS = re.compile(r"^vllm:external_prefix_cache_hits_total(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)


def shared_prefix_workload(docs: int, questions: int, doc_tokens: int, question_tokens: int = 48,
                           vocab: int = 500, seed: int = 0) -> list[list[int]]:
    """``docs`` documents, each followed by ``questions`` different questions (token ids)."""
    rng = random.Random(seed)
    out = []
    for _ in range(docs):
        doc = [rng.randrange(2, vocab) for _ in range(doc_tokens)]
        out += [doc + [rng.randrange(2, vocab) for _ in range(question_tokens)] for _ in range(questions)]
    return out


@dataclass
class Sample:
    prompt_tokens: int
    pool_tokens: int
    ttft_ms: float


def _pool_hits(base: str, timeout: float) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=timeout) as r:
        return sum(float(v) for v in _HITS.findall(r.read().decode()))


def _ttft_ms(base: str, model: str, prompt: list[int], timeout: float) -> float:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data:") and b'"text"' in line:
                ttft = (time.perf_counter() - t) * 1e3
                for _ in r:  # drain the stream so the request completes
                    pass
                return ttft
    raise RuntimeError("the server streamed no token")


def run(url: str, prompts: list[list[int]], timeout: float = 120.0, out=sys.stdout) -> list[Sample]:
    base = url.rstrip("/")
    with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout) as r:
        model = json.load(r)["data"][0]["id"]
    samples = []
    for i, p in enumerate(prompts):
        before = _pool_hits(base, timeout)
        ttft = _ttft_ms(base, model, p, timeout)
        samples.append(Sample(len(p), int(_pool_hits(base, timeout) - before), ttft))
        done = (i + 1) * 30 // len(prompts)
        out.write(f"\r[{'#' * done}{'.' * (30 - done)}] {i + 1}/{len(prompts)}")
        out.flush()
    out.write("\n")
    return samples


def summary(samples: list[Sample]) -> str:
    hit = [s.ttft_ms for s in samples if s.pool_tokens]
    miss = [s.ttft_ms for s in samples if not s.pool_tokens]
    med = lambda xs: f"{statistics.median(xs):.1f}" if xs else "-"  # noqa: E731
    p90 = lambda xs: f"{sorted(xs)[int(0.9 * (len(xs) - 1))]:.1f}" if xs else "-"  # noqa: E731
    rows = [f"{'':<10}{'requests':>9}{'prompt tok':>11}{'pool tok':>10}{'TTFT p50 ms':>13}{'p90 ms':>9}"]
    for name, xs, sel in (("pool hit", hit, [s for s in samples if s.pool_tokens]),
                          ("miss", miss, [s for s in samples if not s.pool_tokens])):
        rows.append(f"{name:<10}{len(sel):>9}{sum(s.prompt_tokens for s in sel):>11}"
                    f"{sum(s.pool_tokens for s in sel):>10}{med(xs):>13}{p90(xs):>9}")
    return "\n".join(rows)


def plot(samples: list[Sample], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, color, sel in (("pool hit", "tab:green", lambda s: s.pool_tokens > 0),
                              ("miss (recomputed)", "tab:red", lambda s: s.pool_tokens == 0)):
        pts = [(i, s.ttft_ms) for i, s in enumerate(samples) if sel(s)]
        if pts:
            ax.scatter(*zip(*pts), label=label, color=color)
    ax.set_xlabel("request")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT with and without a pool hit")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
