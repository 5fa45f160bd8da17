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


def test_hook_trace_is_found_as_a_vllm_plugin_and_folds_a_steps_layers(tmp_path):
    """benchmarks/hook_trace.py: the entry point it writes is what vLLM's plugin loader
    finds (importlib.metadata, group vllm.general_plugins), and a timeline keeps only a
    window's events, folds a step's per-layer hooks and extra calls into one row each
    and starts a new row per step."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import hook_trace
    finally:
        sys.path.pop(0)
    root = hook_trace.plugin_path(str(tmp_path / "plugin"))
    probe = ("from importlib.metadata import entry_points; print([e.value for e in "
             "entry_points(group='vllm.general_plugins') if e.name == 'ascend_trace'])")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.stdout.strip() == "['hook_trace:install']", proc.stderr[-2000:]

    trace = tmp_path / "trace"
    trace.mkdir()
    events = [("EngineCore.step", 10.000, 10.030)]
    for step, t in ((0, 10.001), (1, 10.020)):  # two steps of two layers each
        events.append(("kv.start_load_kv", t, t + 0.001))
        for layer in range(2):
            at = t + 0.002 + 0.003 * layer
            events += [("kv.wait_for_layer_load", at, at + 0.0005),
                       ("x.DevicePath.queue_batch", at, at + 0.0002),
                       ("kv.save_kv_layer", at + 0.001, at + 0.0011)]
        events.append(("kv.wait_for_save", t + 0.009, t + 0.0095))
    events.append(("EngineCore.step", 11.0, 11.01))  # outside the window
    (trace / "123.trace").write_text("".join(f"{n} {a:.7f} {b:.7f}\n" for n, a, b in events))
    (rows,) = hook_trace.timelines(str(trace), [(10.0, 10.05)])
    names = [r[0] for r in rows]
    assert names.count("EngineCore.step") == 1
    assert names.count("kv.wait_for_layer_load") == names.count("kv.start_load_kv") == 2  # one per step
    waits = [r for r in rows if r[0] == "kv.wait_for_layer_load"]
    assert [w[3] for w in waits] == [2, 2] and abs(waits[0][2] - 1.0) < 1e-6  # two calls, 0.5 ms each
    assert abs(waits[0][4] - 6.5) < 1e-6  # the second layer's wait ends 6.5 ms into the window
    assert [r[3] for r in rows if r[0] == "x.DevicePath.queue_batch"] == [2, 2]
    assert hook_trace.summary([rows, rows])[0].startswith("EngineCore.step#1:")
