"""Host time the worker spends per pool hit and per save, outside the copies (CPU).

On the H200 a 32K-token hit spent ~48 ms of host work in ``start_load_kv`` (py-spy,
docs/benchmarks.md): planning, pool calls, header checks, per-object Python. That work
is the same on every device, so it is measured here, on CPU, with the real ``PoolWorker``
and a real local pool, no vLLM engine: one save step of a prompt, then one full-hit load
step into other blocks (checked block for block), repeated.

Two parts of a step are timed apart, on whichever thread runs them: the device work (the
copy-and-sum of ``segments.run_copy``: one kernel on an accelerator, torch ops here) and
the pool's calls (a round trip to the pool process). The rest is host overhead: what the
GPU host pays too. One ``torch`` copy of the same bytes gives the baseline, in the same
run. The per-block path has no such split (each of its copies is a host call): its step
time is printed beside the batched path's.

    python benchmarks/worker_host.py [--tokens 8192 32768] [--geometry qwen2.5-7b/b16]
                                     [--copy-path batched per_block] [--repeat 5]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lookup import fake_vllm  # noqa: E402

from ascend_store import kernels  # noqa: E402
from ascend_store.backends.local.launcher import ping  # noqa: E402
from ascend_store.config import StoreConfig  # noqa: E402
from ascend_store.metadata import ChunkLoad, ChunkSave, StepMetadata  # noqa: E402
from ascend_store.pool_worker import PoolWorker  # noqa: E402

# name: (layers, kv heads, head dim, block size), bf16, 256-token objects
GEOMETRIES = {"qwen2.5-7b/b16": (28, 4, 128, 16), "llama3-8b/b16": (32, 8, 128, 16),
              "qwen2.5-7b/b128": (28, 4, 128, 128)}
DEVICE_WORK = ((kernels, "copy_segments_sum_torch"),)  # raw codec
ROUNDS = itertools.count()
POOL_CALLS = ("lease", "release", "reserve", "commit", "abort", "remove")


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


def run(geometry: str, tokens: int, copy_path: str, repeat: int, socket: str, timers: Timers) -> dict:
    layers, kv_heads, head_dim, block = GEOMETRIES[geometry]
    blocks = tokens // block
    vllm_config, kv_cache_config, caches = engine_parts(layers, kv_heads, head_dim, block, 2 * blocks + 1)
    cfg = StoreConfig.parse({"copy_path": copy_path, "local": {"socket": socket, "start": "never"}})
    worker = PoolWorker(vllm_config, kv_cache_config, cfg, "kv_both")
    worker.register_kv_caches(caches)
    for name in POOL_CALLS:
        timers.wrap(worker.backend, name, "pool")
    per_chunk = worker.blocks_per_chunk
    chunks = blocks // per_chunk
    src = list(range(1, blocks + 1))
    dst = list(range(blocks + 1, 2 * blocks + 1))
    objects = chunks * layers
    out = {"geometry": geometry, "tokens": tokens, "copy_path": copy_path, "objects": objects,
           "save": [], "load": []}
    for r in range(repeat):
        # Fresh objects every round and every case (the pool keeps what was saved first).
        hashes = [f"{next(ROUNDS):08x}{c:024x}" for c in range(chunks)]
        save = StepMetadata(saves=[ChunkSave("req", 0, h, src[c * per_chunk:(c + 1) * per_chunk])
                                   for c, h in enumerate(hashes)])

        def do_save():
            for name in worker.order:
                worker.save_kv_layer(name, save)
            worker.wait_for_save(save)
            worker.handle_preemptions(None)  # the deferred drain: copies done, objects committed

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
            t0 = time.perf_counter()
            fn()
            out[kind].append({"wall": time.perf_counter() - t0, **timers.take()})
        if out["failed"]:
            raise SystemExit(f"{out['failed']} blocks failed to load")
        for name in worker.order:  # the hit landed, block for block
            if not torch.equal(caches[name][:, dst], caches[name][:, src]):
                raise SystemExit(f"{name}: loaded blocks differ from the saved ones")
        worker.wait_for_save(None)
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


def report(res: dict) -> None:
    memcpy_ms = res["memcpy"] * 1e3
    for kind in ("save", "load"):
        rows = res[kind][1:] or res[kind]  # the first round warms caches and allocators
        med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
        host = statistics.median(r["wall"] - r["device"] - r["pool"] for r in rows) * 1e3
        print(f"{res['geometry']:>16} {res['tokens']:>6} {res['copy_path']:>9} {kind:>4}: "
              f"step {med['wall']:7.1f} ms (one memcpy of the bytes {memcpy_ms:6.1f} ms), device work "
              f"{med['device']:6.1f} ms, pool calls {med['pool']:6.1f} ms, host "
              f"{host:6.1f} ms = {host * 1e3 / res['objects']:5.1f} us/object ({res['objects']} objects)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--geometry", nargs="+", default=["qwen2.5-7b/b16"], choices=list(GEOMETRIES))
    ap.add_argument("--copy-path", nargs="+", default=["batched", "per_block"])
    ap.add_argument("--repeat", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    sock = tempfile.mkdtemp(prefix="ascend-store-host-") + "/pool.sock"
    need = max(GEOMETRIES[g][0] * 2 * GEOMETRIES[g][1] * GEOMETRIES[g][2] * 2 for g in args.geometry)
    cap = need * max(args.tokens) * 2  # a round's objects, and room: older rounds are evicted
    server = subprocess.Popen([sys.executable, "-m", "ascend_store.cli", "pool", "serve", "--socket", sock,
                               "--capacity", str(cap)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    timers = Timers()
    for owner, name in DEVICE_WORK:
        timers.wrap(owner, name, "device")
    try:
        while not ping(sock):
            time.sleep(0.05)
        for g in args.geometry:
            for t in args.tokens:
                for path in args.copy_path:
                    report(run(g, t, path, args.repeat, sock, timers))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
