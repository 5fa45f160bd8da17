"""Benchmarks the docs quote must keep running: each is run here at a small size
(benchmarks/lookup.py: about 10 s, a real local pool)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_lookup_benchmark_runs_and_every_lookup_hits():
    args = ["--requests", "4", "--tokens", "1024", "--layers", "2", "--steps", "2", "--capacity", "64MiB"]
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "lookup.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.startswith(("off ", "on "))}
    assert set(rows) == {"off", "on"}
    # 8 chunks per prompt, 7 of them shared: with the cache those are asked once, not per request.
    assert rows["off"][-1] == rows["on"][-1] == "True"
    assert int(rows["on"][-2]) < int(rows["off"][-2])


def test_disk_tier_benchmark_runs(tmp_path):
    """benchmarks/disk_tier.py at 4 objects of 1 MiB, one round (about 2 s)."""
    out = tmp_path / "disk.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "disk_tier.py"), "--objects", "4",
                           "--object-mib", "1", "--rounds", "1", "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["gbps"]
    assert {"tier write", "tier read cold", "plain read cold", "cp"} <= set(rows)
    assert all(v > 0 for v in rows.values())
