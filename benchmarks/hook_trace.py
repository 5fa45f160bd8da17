"""A timeline of an engine's host work across vLLM's processes, for ``e2e_gpu.py --trace``.

Loaded as a vLLM general plugin (``e2e_gpu.py`` writes its entry point into a directory on
the engine's PYTHONPATH), so it runs in the engine-core process as well as the front end.
It wraps the calls a hit's time goes through: the engine step, the scheduler, the
executor's calls into the worker, the wait for the sampled token, and every connector hook
(any connector: ours, LMCache's, vLLM's native offloading). Each process appends
``name start end`` lines to ``$ASCEND_TRACE_DIR/<pid>.trace``; times are ``perf_counter``
seconds, CLOCK_MONOTONIC on Linux, so one clock for every process of the machine and the
front end's request interval lines up with the engine core's events.

``ASCEND_TRACE_SAMPLE_MS=0.5`` also samples, every that many ms, the Python stack of the
thread inside the worker's ``execute_model`` (input preparation, hooks, forward): where
its host time goes, including waits in C calls (shown as the Python line that made them).
The sampler takes the GIL for ~10 us a sample, so it slows what it measures a little.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import Counter, defaultdict

ENV = "ASCEND_TRACE_DIR"
# More calls to time, "module:Class.method,...": they show as "x.Class.method", folded per step.
EXTRA = "ASCEND_TRACE_EXTRA"
CONNECTOR_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                   "update_connector_output", "request_finished", "handle_preemptions", "start_load_kv",
                   "wait_for_layer_load",
                   "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
                   "build_connector_worker_meta", "get_kv_connector_stats")
SAMPLE = "ASCEND_TRACE_SAMPLE_MS"
_out = None
_pid = 0
_busy: list[int] = []  # the thread inside the worker's execute_model


def record(name: str, t0: float, t1: float) -> None:
    global _out, _pid
    if _pid != os.getpid():  # first event of this process (a forked child must not share a file)
        _pid = os.getpid()
        _out = open(os.path.join(os.environ[ENV], f"{_pid}.trace"), "a", buffering=1 << 16)
    _out.write(f"{name} {t0:.7f} {t1:.7f}\n")


def timed(fn, name: str):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(name, t0, time.perf_counter())
            _out.flush()  # a write of a few us: the front end reads the files while the engine runs
    return run


def _sampled(fn):
    """``execute_model`` with its thread sampled while inside (a sampler per process)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not getattr(run, "sampler", None):
            every = float(os.environ[SAMPLE]) / 1e3
            run.sampler = threading.Thread(target=_sample, args=(every,), daemon=True)
            run.sampler.start()
        _busy.append(threading.get_ident())
        try:
            return fn(*args, **kwargs)
        finally:
            _busy.pop()
    return run


def _sample(interval: float, depth: int = 5) -> None:
    while True:
        time.sleep(interval)
        if not _busy:
            continue
        frame = sys._current_frames().get(_busy[-1])
        where = []
        while frame is not None and len(where) < depth:
            code = frame.f_code
            where.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}")
            frame = frame.f_back
        t = time.perf_counter()
        record("S|" + "<".join(where), t, t)


def _connector_factory(create):
    def run(*args, **kwargs):
        conn = create(*args, **kwargs)
        for hook in CONNECTOR_HOOKS:
            if hasattr(conn, hook):  # an instance attribute shadows the class's method
                setattr(conn, hook, timed(getattr(conn, hook), f"kv.{hook}"))
        return conn
    return run


def install() -> None:
    """The plugin's entry point: vLLM calls it in every process, possibly more than once."""
    if not os.environ.get(ENV) or getattr(sys, "_ascend_trace", False):
        return
    sys._ascend_trace = True
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.executor.uniproc_executor import AsyncOutputFuture, UniProcExecutor

    for cls, attr in ((EngineCore, "step"), (EngineCore, "step_with_batch_queue"),
                      (Scheduler, "schedule"), (Scheduler, "update_from_output"),
                      (AsyncOutputFuture, "result"), (UniProcExecutor, "execute_model"),
                      (UniProcExecutor, "sample_tokens"), (MultiprocExecutor, "execute_model"),
                      (MultiprocExecutor, "sample_tokens")):
        setattr(cls, attr, timed(getattr(cls, attr), f"{cls.__name__}.{attr}"))
    if os.environ.get(SAMPLE):  # the worker's, in whichever process runs it
        from vllm.v1.worker.gpu_worker import Worker

        Worker.execute_model = _sampled(Worker.execute_model)
    import importlib

    for spec in filter(None, os.environ.get(EXTRA, "").split(",")):
        module, _, path = spec.partition(":")
        cls_name, _, attr = path.partition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        setattr(cls, attr, timed(getattr(cls, attr), f"x.{cls_name}.{attr}"))
    create = KVConnectorFactory.create_connector
    KVConnectorFactory.create_connector = staticmethod(_connector_factory(create))


def plugin_path(root: str) -> str:
    """A directory that, on PYTHONPATH, makes vLLM load ``install`` as a general plugin."""
    info = os.path.join(root, "ascend_trace-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: ascend-trace\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nascend_trace = hook_trace:install\n")
    return root


def load(root: str) -> dict[int, list[tuple[str, float, float]]]:
    events = {}
    for name in os.listdir(root):
        if name.endswith(".trace"):
            with open(os.path.join(root, name)) as f:
                rows = [ln.split() for ln in f if ln.strip()]
            events[int(name.split(".")[0])] = sorted((r[0], float(r[1]), float(r[2])) for r in rows
                                                     if len(r) == 3)
    return events


PER_LAYER = ("kv.wait_for_layer_load", "kv.save_kv_layer")


def timelines(root: str, windows: list[tuple[float, float]]) -> list[list[list]]:
    """Per request window (front-end send, receive), the engine processes' events in it as
    [name, start ms, busy ms, calls, end ms] rows from the window's start; a step's per-layer
    hooks and extra calls (between ``start_load_kv`` and ``wait_for_save``) fold into one
    row each."""
    events = load(root)
    out = []
    for a, b in windows:
        rows: list[list] = []
        for evs in events.values():
            folding: dict[str, list] = {}
            for name, t0, t1 in sorted(evs, key=lambda e: e[1]):
                if t1 < a or t0 > b or name.startswith("S|"):
                    continue
                if name in ("kv.start_load_kv", "kv.wait_for_save"):
                    folding = {}
                row = folding.get(name)
                if row is not None:
                    row[2] += (t1 - t0) * 1e3
                    row[3] += 1
                    row[4] = (t1 - a) * 1e3
                    continue
                rows.append([name, (t0 - a) * 1e3, (t1 - t0) * 1e3, 1, (t1 - a) * 1e3])
                if name in PER_LAYER or name.startswith("x."):
                    folding[name] = rows[-1]
        rows.sort(key=lambda r: r[1])
        out.append([[n, round(s, 3), round(d, 3), c, round(e, 3)] for n, s, d, c, e in rows])
    return out


def samples(root: str, windows: list[tuple[float, float]], top: int = 30) -> list[tuple[str, int]]:
    """The most frequent sampled stacks (innermost frame first) in the windows, counted
    over all of them, with the number of windows' samples in all as ("all", n)."""
    got: Counter = Counter()
    for evs in load(root).values():
        for name, t0, _ in evs:
            if name.startswith("S|") and any(a <= t0 <= b for a, b in windows):
                got[name[2:]] += 1
    return [("all", sum(got.values())), *got.most_common(top)]


def summary(lines: list[list[list]]) -> list[str]:
    """Median start, busy time and end of each event over the windows, in order of start."""
    acc = defaultdict(list)
    for rows in lines:
        seen: dict[str, int] = defaultdict(int)
        for name, start, busy, calls, end in rows:
            seen[name] += 1
            acc[(name, seen[name])].append((start, busy, calls, end))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    keyed = sorted(acc.items(), key=lambda kv: med([v[0] for v in kv[1]]))
    return [f"{name}#{k}: {med([v[0] for v in vs]):7.2f} -> {med([v[3] for v in vs]):7.2f} ms, "
            f"busy {med([v[1] for v in vs]):6.2f} ms x{med([v[2] for v in vs])} ({len(vs)}/{len(lines)})"
            for (name, k), vs in keyed]


def totals(rows: list[list]) -> list[str]:
    """One window's events summed per name (a burst of many steps): calls, busy ms, and
    the first start and last end, in order of first start."""
    acc: dict[str, list] = {}
    for name, start, busy, calls, end in rows:
        a = acc.setdefault(name, [start, 0.0, 0, end])
        a[1] += busy
        a[2] += calls
        a[3] = max(a[3], end)
    return [f"{name}: {s:7.1f} -> {e:7.1f} ms, busy {b:7.2f} ms x{c}"
            for name, (s, b, c, e) in sorted(acc.items(), key=lambda kv: kv[1][0])]
