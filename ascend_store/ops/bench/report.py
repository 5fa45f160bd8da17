"""The summary table, the JSON result and the PNG plot of a bench run."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict

from ascend_store.ops.bench.client import Sample

PLOT_EXTRA = "pip install 'ascend-store[bench]'"


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q of the values at or below."""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def _row(name: str, sel: list[Sample]) -> dict:
    ttft = [s.ttft_ms for s in sel]
    known = [s.pool_tokens for s in sel if s.pool_tokens is not None]
    prompt = sum(s.prompt_tokens or 0 for s in sel)
    pool = sum(known) if known else None
    return {"name": name, "requests": len(sel), "prompt_tokens": prompt, "pool_tokens": pool,
            "pool_share": round(pool / prompt, 3) if pool is not None and prompt else None,
            "ttft_p50_ms": statistics.median(ttft), "ttft_p90_ms": _pct(ttft, 0.9),
            "ttft_mean_ms": statistics.fmean(ttft),
            "latency_p50_ms": statistics.median(s.latency_ms for s in sel)}


def summarize(samples: list[Sample]) -> list[dict]:
    """One row per phase (in order), then pool hits and misses, then everything."""
    phases = list(dict.fromkeys(s.phase for s in samples))
    rows = [_row(p, [s for s in samples if s.phase == p]) for p in phases] if len(phases) > 1 else []
    for name, sel in (("pool hit", [s for s in samples if s.pool_tokens]),
                      ("miss", [s for s in samples if s.pool_tokens == 0])):
        if sel:
            rows.append(_row(name, sel))
    return rows + [_row("all", samples)]


def table(rows: list[dict]) -> str:
    cols = [("requests", "requests", "d"), ("prompt tok", "prompt_tokens", "d"),
            ("pool tok", "pool_tokens", "d"), ("pool %", "pool_share", "%"),
            ("TTFT p50 ms", "ttft_p50_ms", ".1f"), ("p90 ms", "ttft_p90_ms", ".1f"),
            ("mean ms", "ttft_mean_ms", ".1f"), ("latency p50 ms", "latency_p50_ms", ".1f")]
    out = [f"{'':<14}" + "".join(f"{h:>{len(h) + 2}}" for h, _, _ in cols)]
    for r in rows:
        cells = []
        for head, key, fmt in cols:
            v = r[key]
            text = "-" if v is None else f"{100 * v:.0f}" if fmt == "%" else format(v, fmt)
            cells.append(f"{text:>{len(head) + 2}}")
        out.append(f"{r['name']:<14}" + "".join(cells))
    return "\n".join(out)


def write_json(path: str, meta: dict, rows: list[dict], samples: list[Sample]) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "summary": rows, "requests": [asdict(s) for s in samples]}, f, indent=1)


def check_plot_support() -> str | None:
    """Why a plot cannot be drawn here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}"
    return None


def plot(samples: list[Sample], rows: list[dict], title: str, path: str) -> None:
    """Left: TTFT of every request in order, a colour per phase, hits filled and misses
    hollow. Right: median TTFT per phase (or hit/miss when there is one phase)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    phases = list(dict.fromkeys(s.phase for s in samples))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, phase in enumerate(phases):
        c = colors[i % len(colors)]
        for hit in (True, False):
            pts = [(n, s.ttft_ms) for n, s in enumerate(samples)
                   if s.phase == phase and bool(s.pool_tokens) == hit]
            if pts:
                left.scatter(*zip(*pts), color=c, facecolors=c if hit else "none",
                             label=f"{phase} ({'pool hit' if hit else 'miss'})")
    left.set_xlabel("request")
    left.set_ylabel("TTFT (ms)")
    left.set_ylim(bottom=0)
    left.legend(fontsize="small")
    bars = [r for r in rows if r["name"] != "all"]
    right.bar([r["name"] for r in bars], [r["ttft_p50_ms"] for r in bars],
              color=[{"pool hit": "tab:green", "miss": "tab:red"}.get(r["name"], "tab:blue") for r in bars])
    right.set_ylabel("median TTFT (ms)")
    right.tick_params(axis="x", labelrotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
