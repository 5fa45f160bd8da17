"""Host time the worker spends per pool hit and per save, outside the copies (CPU).

A hit's host work in ``start_load_kv`` (planning, pool calls, header checks, per-object
Python) and a save's are the same on every device, so they are measured here, on CPU,
with the real ``PoolWorker`` and a real local pool, no vLLM engine: one save step of a
prompt, then one full-hit load step into other blocks (checked block for block),
repeated (results: docs/benchmarks.md, "The worker's host time per hit and per save").

Two parts of a step are timed apart, on whichever thread runs them: the device work (the
copy-and-sum of ``segments.run_copy``: one kernel on an accelerator, torch ops here) and
the pool's calls (a round trip to the pool process). The rest is host overhead: what the
GPU host pays too. One ``torch`` copy of the same bytes gives the baseline, in the same
run. The per-block path has no such split (each of its copies is a host call): its step
time is printed beside the batched path's.

On this CPU the copy-and-sum runs as a Python loop of torch ops (about a second per
32K-token step), so the host part would be a small difference of two large numbers on
a busy machine: ``--device-work skip`` runs the first round for real (and checks every
loaded block), then replaces the copy with a no-op so later rounds time only the host
and the pool. ``--checkouts A B`` measures other checkouts of the project in the same
run (before/after), each in its own process against its own pool; ``--turns N`` runs
them in turn N times and pools their rounds, since this machine's speed drifts for
minutes at a time (a run of one after the other can put them in different spells). The
pool's round trips per step are counted too; the best round is printed beside the
medians (noise only adds to a round).

    python benchmarks/worker_host.py [--tokens 8192 32768] [--geometry qwen2.5-7b/b16]
                                     [--copy-path batched per_block] [--repeat 5]
                                     [--device-work real|skip] [--checkouts DIR ...]
                                     [--turns N] [--profile FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import itertools
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.environ.get("ASCEND_STORE_CHECKOUT", os.path.join(HERE, "..")))
sys.path.insert(1, HERE)
from lookup import fake_vllm  # noqa: E402

from ascend_store.backends.local.launcher import ping  # noqa: E402
from ascend_store.common.config import StoreConfig  # noqa: E402
from ascend_store.common.metadata import ChunkLoad, ChunkSave, StepMetadata  # noqa: E402
from ascend_store.device import kernels  # noqa: E402
from ascend_store.worker.pool_worker import PoolWorker  # noqa: E402

# name: (layers, kv heads, head dim, block size), bf16, 256-token objects
GEOMETRIES = {"qwen2.5-7b/b16": (28, 4, 128, 16), "llama3-8b/b16": (32, 8, 128, 16),
              "qwen2.5-7b/b128": (28, 4, 128, 128), "llama-1b/b16": (16, 8, 64, 16)}
# The raw codec's copy-and-sum, done by one kernel on an accelerator.
DEVICE_WORK = ((kernels, "copy_segments_sum_torch"), (kernels, "add_to_objects"))
ROUNDS = itertools.count()
POOL_CALLS = ("lease", "lease_slots", "release", "reserve", "reserve_slots", "commit", "abort", "remove")


class Timers:
    """Seconds spent in wrapped functions, summed over threads."""

    def __init__(self):
        self.seconds = {"device": 0.0, "pool": 0.0}

    def wrap(self, owner, name: str, part: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds[part] += time.perf_counter() - t0

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        out, self.seconds = self.seconds, {k: 0.0 for k in self.seconds}
        return out


def engine_parts(layers: int, kv_heads: int, head_dim: int, block: int, num_blocks: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vllm_config, groups = fake_vllm(layers, block)
    names = groups.kv_cache_groups[0].layer_names
    spec = FullAttentionSpec(block_size=block, num_kv_heads=kv_heads, head_size=head_dim,
                             dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks, [], [KVCacheGroupSpec(names, spec)])
    caches = {n: torch.randn(2, num_blocks, block, kv_heads, head_dim).to(torch.bfloat16) for n in names}
    return vllm_config, kv_cache_config, caches


def run(geometry: str, tokens: int, copy_path: str, repeat: int, socket: str, timers: Timers,
        skip_device: bool, profiler=None) -> dict:
    layers, kv_heads, head_dim, block = GEOMETRIES[geometry]
    blocks = tokens // block
    vllm_config, kv_cache_config, caches = engine_parts(layers, kv_heads, head_dim, block, 2 * blocks + 1)
    cfg = StoreConfig.parse({"copy_path": copy_path, "local": {"socket": socket, "start": "never"}})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    worker.register_kv_caches(caches)
    # Map every page of the arena in this process, as an accelerator's registration of it
    # as pinned memory does (cudaHostRegister) and its copies would: with the copies
    # skipped, each save's headers would otherwise land on pages this process never
    # touched, one minor fault each (~480 a 32K step, +1.2 ms on the dev machine).
    if hasattr(worker, "ctx"):
        worker.ctx.arena().numpy()[::mmap.PAGESIZE].sum()
    for name in POOL_CALLS:
        if hasattr(worker.backend, name):  # older checkouts lack the array calls
            timers.wrap(worker.backend, name, "pool")
    per_chunk = worker.blocks_per_chunk
    chunks = blocks // per_chunk
    src = list(range(1, blocks + 1))
    dst = list(range(blocks + 1, 2 * blocks + 1))
    objects = chunks * layers
    out = {"geometry": geometry, "tokens": tokens, "copy_path": copy_path, "objects": objects,
           "save": [], "load": []}
    real_copy, real_rows = kernels.copy_segments_sum_torch, getattr(kernels, "load_rows_torch", None)
    for r in range(repeat):
        if skip_device and r == 1 and copy_path == "batched":
            kernels.copy_segments_sum_torch = _no_copy
            if hasattr(kernels, "load_rows_torch"):  # loads in batches of layers (older checkouts: none)
                kernels.load_rows_torch = _no_rows
        # Fresh objects every round and every case (the pool keeps what was saved first).
        hashes = [f"{next(ROUNDS):08x}{c:024x}" for c in range(chunks)]
        # Published when wait_for_save returns (a P/D producer's last prompt step), so the
        # step's time holds the commit and the load finds every object. Checkouts older than
        # commit_now published a save in the next step's first hook: do_save calls it.
        publish = "commit_now" in StepMetadata.__dataclass_fields__
        flags = {"commit_now": True} if publish else {}
        save = StepMetadata(saves=[ChunkSave("req", 0, h, src[c * per_chunk:(c + 1) * per_chunk])
                                   for c, h in enumerate(hashes)], **flags)

        def do_save():
            for name in worker.order:
                worker.save_kv_layer(name, save)
            worker.wait_for_save(save)
            if not publish:
                worker.handle_preemptions(None)

        load = StepMetadata(loads=[ChunkLoad("req", 0, h, dst[c * per_chunk:(c + 1) * per_chunk])
                                   for c, h in enumerate(hashes)])

        def do_load():
            worker.handle_preemptions(load)
            worker.start_load_kv(load)
            for name in worker.order:
                worker.wait_for_layer_load(name)
            out["failed"] = len(worker.get_block_ids_with_load_errors())

        for kind, fn in (("save", do_save), ("load", do_load)):
            timers.take()
            rpcs = worker.backend.rpcs
            profiling = profiler is not None and r > 0
            if profiling:
                profiler.enable()
            t0 = time.perf_counter()
            fn()
            if profiling:
                profiler.disable()
            wall, times = time.perf_counter() - t0, timers.take()
            # A load's leases are released on the load thread, off the step: count that call
            # (older checkouts have no such thread).
            after = getattr(getattr(worker, "loader", None), "_thread", None)
            if kind == "load" and after is not None:
                after.submit(lambda: None).result()
            out[kind].append({"wall": wall, **times, "rpcs": worker.backend.rpcs - rpcs})
        if out["failed"] and kernels.copy_segments_sum_torch is real_copy:
            raise SystemExit(f"{out['failed']} blocks failed to load")
        for name in worker.order if kernels.copy_segments_sum_torch is real_copy else ():  # block for block
            if not torch.equal(caches[name][:, dst], caches[name][:, src]):
                raise SystemExit(f"{name}: loaded blocks differ from the saved ones")
        worker.wait_for_save(None)
    kernels.copy_segments_sum_torch = real_copy
    if real_rows is not None:
        kernels.load_rows_torch = real_rows
    worker.shutdown()
    # Baseline: the same bytes in one torch copy, per direction.
    nbytes = sum(c[:, src].numel() * c.element_size() for c in caches.values())
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    t0 = time.perf_counter()
    b.copy_(a)
    out["memcpy"] = time.perf_counter() - t0
    out["bytes"] = nbytes
    return out


def _no_copy(src, dst, src_offs, dst_offs, sums, seg_words) -> None:
    """--device-work skip: the copy-and-sum's stand-in after the first (checked) round;
    its sums are zero for saves and loads alike, so the loads' checks pass."""
    sums.zero_()


def _no_rows(src, dsts, segs, obj_base, layer_base, sums, seg_words) -> None:
    """The same stand-in for a batch of layers' load (kernels.load_rows_torch)."""
    sums.zero_()


def report(res: dict, label: str, warm: int = 1) -> None:
    """``warm``: first rounds left out (they warm caches and allocators)."""
    memcpy_ms = res["memcpy"] * 1e3
    for kind in ("save", "load"):
        rows = res[kind][warm:] or res[kind]
        med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
        host = statistics.median(r["wall"] - r["device"] - r["pool"] for r in rows) * 1e3
        best = min(r["wall"] - r["device"] for r in rows) * 1e3  # this VM's noise only adds
        rpcs = max(r["rpcs"] for r in rows)
        print(f"{label:>8} {res['geometry']:>14} {res['tokens']:>6} {res['copy_path']:>9} {kind:>4}: "
              f"step {med['wall']:7.1f} ms (one memcpy of the bytes {memcpy_ms:6.1f} ms), device work "
              f"{med['device']:6.1f} ms, pool calls {med['pool']:5.1f} ms in {rpcs} round trips, host "
              f"{host:6.1f} ms, host + pool {host + med['pool']:6.1f} ms (best round {best:5.1f}) "
              f"({res['objects']} (layer, chunk) pieces)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--geometry", nargs="+", default=["qwen2.5-7b/b16"], choices=list(GEOMETRIES))
    ap.add_argument("--copy-path", nargs="+", default=["batched", "per_block"])
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--device-work", choices=("real", "skip"), default="real")
    ap.add_argument("--checkouts", nargs="*", default=[],
                    help="other checkouts of this project to measure in the same run (own processes)")
    ap.add_argument("--label", default="this")
    ap.add_argument("--profile", metavar="FILE",
                    help="cProfile the timed steps after the first round (hooks and pool calls only)")
    ap.add_argument("--turns", type=int, default=1,
                    help="run the checkouts and this one in turn this many times, each in a fresh process, "
                         "and report over all turns: this machine's speed drifts for minutes at a time")
    ap.add_argument("--rows", help=argparse.SUPPRESS)  # a turn's process: write its results here
    args = ap.parse_args()
    if args.rows is None and (args.checkouts or args.turns > 1):
        take_turns(args)
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    sock = tempfile.mkdtemp(prefix="ascend-store-host-") + "/pool.sock"
    need = max(GEOMETRIES[g][0] * 2 * GEOMETRIES[g][1] * GEOMETRIES[g][2] * 2 for g in args.geometry)
    cap = need * max(args.tokens) * 2  # a round's objects, and room: older rounds are evicted
    server = subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli",
                               "pool", "serve", "--socket", sock,
                               "--capacity", str(cap)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": sys.path[0]}, cwd=sys.path[0])  # -m: cwd first
    timers = Timers()
    profiler = cProfile.Profile() if args.profile else None
    for owner, name in DEVICE_WORK:
        if hasattr(owner, name):  # older checkouts sum per segment only
            timers.wrap(owner, name, "device")
    results = []
    try:
        while not ping(sock):
            time.sleep(0.05)
        for g in args.geometry:
            for t in args.tokens:
                for path in args.copy_path:
                    res = run(g, t, path, args.repeat, sock, timers, args.device_work == "skip", profiler)
                    results.append(res)
                    if args.rows is None:
                        report(res, args.label)
        if args.rows is not None:
            with open(args.rows, "w") as f:
                json.dump(results, f)
        if profiler is not None:
            profiler.dump_stats(args.profile)
    finally:
        server.terminate()
        server.wait()


def take_turns(args) -> None:
    """Every checkout (``--checkouts``, then this one) in its own process and pool, in turn,
    ``--turns`` times; each process's first round is left out, the rest pooled per case."""
    argv = [a for a in sys.argv[1:] if a not in args.checkouts and a != "--checkouts"]
    tmp = tempfile.mkdtemp(prefix="ascend-store-turns-")
    pooled: dict[tuple, dict] = {}
    for turn in range(args.turns):
        for other in [*args.checkouts, None]:
            label = os.path.basename(os.path.abspath(other)) if other else args.label
            env = dict(os.environ)
            if other:
                env.update(ASCEND_STORE_CHECKOUT=os.path.abspath(other), PYTHONPATH=os.path.abspath(other))
            out = os.path.join(tmp, f"{label}-{turn}.json")
            subprocess.run([sys.executable, __file__, *argv, "--label", label, "--rows", out], env=env,
                           check=True)
            with open(out) as f:
                for res in json.load(f):
                    key = (label, res["geometry"], res["tokens"], res["copy_path"])
                    got = pooled.setdefault(key, {**res, "save": [], "load": [], "memcpy": []})
                    got["save"] += res["save"][1:]
                    got["load"] += res["load"][1:]
                    got["memcpy"].append(res["memcpy"])
    for (label, *_), res in pooled.items():
        report({**res, "memcpy": statistics.median(res["memcpy"])}, label, warm=0)


if __name__ == "__main__":
    main()
