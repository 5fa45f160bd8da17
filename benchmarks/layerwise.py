"""How much of a pool load the layerwise pipeline hides behind the forward (GPU).

A synthetic forward with each layer's real work for Llama-3-8B and Qwen2.5-7B geometry
(QKV and output projections, attention of the new tokens over the cached prefix read
from the paged cache, the gated MLP; bf16), fed by the connector's own load pipeline
(``ascend_store.device.device_path.DevicePath``: the pool's chunk objects, every layer of a
chunk in one object, side by side in the pinned arena as one request's save leaves them;
in batches of layers, one 2D DMA per batch and one scatter-and-sum kernel on side
streams, from one copy plan per step, queued as the worker queues them (loads.py: all
first for a short forward, else each batch from the wait of the layer before it); the
compute stream waits on each layer's batch before that layer runs; checksums compared
at the end). For each case, in one run:

  ceiling    one pinned host->device copy of the same bytes (the link's limit)
  load       the pipeline alone: all layers' objects into the cache
  save       the save path alone: all layers' blocks into their object slots
  compute    the forward alone
  overlap    the forward with the load running under it
  hidden     (load + compute - overlap) / load: the share of the load that cost no time
  *_host     the host's time to queue a load's batches (and wait calls) or a save's
             layers, until it waits for the device: the part a forward must hide

Runs with torch, triton and this package only (no vLLM):
    python benchmarks/layerwise.py [--cached 4096 16384 32768] [--new 512 2048] [--geometry ...]
                                   [--codec raw int8] [--json out.json] [--profile FILE]
                                   [--timeline DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import mmap
import os
import pstats
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ascend_store.common.codecs import get_codec  # noqa: E402
from ascend_store.common.transfer import HEADER_BYTES, LayerLayout, object_bytes, seal  # noqa: E402
from ascend_store.device.device_path import DevicePath  # noqa: E402
from ascend_store.device.device_work import LayerObjects, queue_window  # noqa: E402
from ascend_store.device.segments import CopyPlanner, StepPages  # noqa: E402

# name: (layers, hidden, heads, kv heads, head dim, ffn, block size); objects of 256 tokens
GEOMETRIES = {"llama3-8b/b16": (32, 4096, 32, 8, 128, 14336, 16),
              "qwen2.5-7b/b128": (28, 3584, 28, 4, 128, 18944, 128)}
CHUNK_TOKENS = 256
ALIGN = 512
LAYERS = HIDDEN = HEADS = KV_HEADS = HEAD_DIM = FFN = BLOCK = CHUNK_BLOCKS = 0  # set by use()


def use(geometry: str) -> None:
    global LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, BLOCK, CHUNK_BLOCKS
    LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, BLOCK = GEOMETRIES[geometry]
    CHUNK_BLOCKS = CHUNK_TOKENS // BLOCK


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Model:
    """Random bf16 weights of one decoder layer, reused by every layer (the work, not
    the values, is what matters here)."""

    def __init__(self, dev):
        g = torch.Generator(device=dev).manual_seed(0)
        w = lambda *s: torch.randn(*s, device=dev, dtype=torch.bfloat16, generator=g) * 0.02  # noqa: E731
        self.qkv = w(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.o = w(HEADS * HEAD_DIM, HIDDEN)
        self.up = w(HIDDEN, 2 * FFN)
        self.down = w(FFN, HIDDEN)

    def layer(self, x, cache, blocks):
        """One layer over ``x`` (new tokens); attention reads the layer's cached prefix
        from its paged cache [2, blocks, BLOCK, KV_HEADS, HEAD_DIM]."""
        m = x.shape[0]
        q = (x @ self.qkv)[:, : HEADS * HEAD_DIM].view(m, HEADS, HEAD_DIM).transpose(0, 1)
        k = cache[0].index_select(0, blocks).reshape(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
        v = cache[1].index_select(0, blocks).reshape(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
        a = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                           enable_gqa=True).squeeze(0)
        x = x + a.transpose(0, 1).reshape(m, -1) @ self.o
        gate, up = (x @ self.up).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.down


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeline(trace: str) -> dict:
    """Where one traced call's time went (a torch.profiler chrome trace, CUDA activity on
    the host's clock): ms from the call's start to its first copy, the copies' busy time
    and the gaps between them, from the last copy's end to the last kernel's end and to
    the call's end. Every copy counts, not only the batches' DMAs: a load's index upload
    and its sums' copy back are copies too, so the gaps include the wait before that copy
    back and the last copy may end after the last kernel (a negative kernel figure)."""
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    call = next(e for e in events if e.get("cat") == "user_annotation" and e["name"] == "call")
    t0, t1 = call["ts"], call["ts"] + call["dur"]
    dmas = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memcpy")
    kernels = [e["ts"] + e["dur"] for e in events if e.get("cat") == "kernel"]
    gaps = sum(max(0.0, b[0] - a[1]) for a, b in zip(dmas, dmas[1:]))
    last = dmas[-1][1] if dmas else t0
    return {"to_first_dma_ms": ((dmas[0][0] if dmas else t0) - t0) / 1e3,
            "dma_busy_ms": sum(b - a for a, b in dmas) / 1e3, "dma_gaps_ms": gaps / 1e3, "dmas": len(dmas),
            "last_kernel_after_dma_ms": (max(kernels, default=last) - last) / 1e3,
            "end_after_dma_ms": (t1 - last) / 1e3, "call_ms": (t1 - t0) / 1e3}


def run_case(cached: int, new: int, reps: int = 5, device: str = "cuda", codec_name: str = "raw",
             profile: cProfile.Profile | None = None, trace_dir: str | None = None) -> dict:
    dev = torch.device(device)
    nblocks = cached // BLOCK
    caches = [torch.zeros(2, nblocks + 8, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
              for _ in range(LAYERS)]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    layouts = {n: LayerLayout(c, 1, (KV_HEADS, BLOCK, HEAD_DIM)) for n, c in zip(names, caches)}
    codec = get_codec(codec_name)
    path = DevicePath(dev, layouts, {n: codec for n in names})
    per_obj = object_bytes(layouts[names[0]], CHUNK_BLOCKS, codec)  # one layer's part of a chunk object
    obj = aligned(per_obj * LAYERS)  # a chunk object: every layer's part
    nobj = nblocks // CHUNK_BLOCKS
    size = obj * nobj
    arena_map = mmap.mmap(-1, size)
    arena = path.arena(0, arena_map)
    blocks = torch.arange(nblocks, device=dev)

    # Fill the arena with sealed objects of random KV, as a previous engine would have.
    src = torch.randn(2, nblocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    filler = LayerLayout(src, 1, (KV_HEADS, BLOCK, HEAD_DIM))
    layers = []
    chunks = [list(range(c * CHUNK_BLOCKS, (c + 1) * CHUNK_BLOCKS)) for c in range(nobj)]
    planner = CopyPlanner(StepPages.of(chunks, [0] * nobj))  # one plan for the step's layers
    for li, name in enumerate(names):
        offs = [c * obj + li * per_obj for c in range(nobj)]
        objs = LayerObjects(name, offs, [per_obj] * nobj, chunks, [0] * nobj,
                            [f"k/L{li}/{c}" for c in range(nobj)], planner=planner)
        filler_path = DevicePath(dev, {name: filler}, {name: codec})
        q = filler_path.save_layer(arena, objs, None)
        objs.stored = filler_path.finish_saves([q])[0]  # what the worker reads from the headers
        for off, s in zip(offs, objs.stored.tolist()):
            seal(arena[off:off + per_obj], per_obj - HEADER_BYTES, layouts[name], "k", codec, True, wsum=s)
        layers.append(objs)
    kv_bytes = 2 * nblocks * BLOCK * KV_HEADS * HEAD_DIM * 2 * LAYERS

    model = Model(dev)
    x0 = torch.randn(new, HIDDEN, device=dev, dtype=torch.bfloat16)

    def forward(before=None):
        x = x0
        for li in range(len(names)):
            if before is not None:
                before(li)  # the worker's wait_for_layer_load
            x = model.layer(x, caches[li], blocks)
        return x

    def new_step() -> None:
        """A step's planner, as the worker builds one per step: its plans and uploads are
        not carried from one timed call to the next."""
        planner = CopyPlanner(StepPages.of(chunks, [0] * nobj))
        for objs in layers:
            objs.planner = planner

    def loader(window: int):
        """The worker's queueing (loads.py): the batches of the first ``window`` layers
        now, each later one from the wait of the layer ``window`` before it; returns the
        queued loads and the wait to call before each layer."""
        new_step()
        batches = path.batches(layers, arena)
        first = [names.index(b.layers[0].name) for b in batches]
        compute = path.dev.current()
        queued, events = [], {}

        def upto(stop):
            while len(queued) < len(batches) and first[len(queued)] < stop:
                batch = batches[len(queued)]
                queued.append(path.queue_batch(arena, batch))
                events.update((o.name, queued[-1].done) for o in batch.layers)

        def wait(li):
            upto(li + 1 + window)
            path.dev.wait(events[names[li]], compute)

        upto(window)
        return queued, wait

    def check(queued):
        for q, per_layer in zip(queued, path.check_loads(queued, True)):
            if any(per_layer):
                raise AssertionError(f"{[o.name for o in q.layers]}: objects failed their checksum")

    host: dict = {}  # per function: host seconds of its last run until it waited for the device

    def timed(fn) -> float:
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        return time.perf_counter() - t0

    def queued_by(fn, t0: float) -> None:
        host[fn] = time.perf_counter() - t0

    # Saves go to a second arena: the loads' stays intact.
    saver = DevicePath(dev, layouts, {n: codec for n in names})
    save_map = mmap.mmap(-1, size)
    save_arena = saver.arena(0, save_map)

    def save_all():  # every layer's blocks into its object slots, as a prefill would
        new_step()
        t0 = time.perf_counter()
        qs = [saver.save_layer(save_arena, objs, None) for objs in layers]
        queued_by(save_all, t0)
        saver.finish_saves(qs)

    def load_only():
        t0 = time.perf_counter()
        queued, wait = loader(LAYERS)
        for li in range(LAYERS):
            wait(li)
        queued_by(load_only, t0)
        host["batches"] = len(queued)
        check(queued)

    def overlap():
        queued, wait = loader(queue_window(new, LAYERS))
        forward(wait)
        check(queued)

    pinned = torch.empty(kv_bytes // LAYERS, dtype=torch.uint8)
    pinned = pinned.pin_memory() if dev.type == "cuda" else pinned
    dst = torch.empty_like(pinned, device=dev)

    def ceiling():
        for _ in range(LAYERS):
            dst.copy_(pinned, non_blocking=True)

    for fn in (ceiling, save_all, load_only, forward, overlap):  # warm up (Triton compile, cuBLAS)
        timed(fn)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    t_ceil, t_comp, t_over = (med([timed(fn) for _ in range(reps)]) for fn in (ceiling, forward, overlap))
    t_load, load_host = map(med, zip(*[(timed(load_only), host[load_only]) for _ in range(reps)]))
    if profile is not None:  # the host's part of the loads and saves, apart
        for fn in (load_only, save_all):
            profile.enable()
            timed(fn)
            profile.disable()
    t_save, save_host = map(med, zip(*[(timed(save_all), host[save_all]) for _ in range(reps)]))
    traced = {}
    if trace_dir is not None:  # one traced call of each, after the timed ones
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        for fn in (ceiling, load_only, save_all, overlap):
            with torch.profiler.profile(activities=acts) as prof:
                with torch.profiler.record_function("call"):
                    timed(fn)
            path_ = os.path.join(trace_dir, f"{cached}_{new}_{codec_name}_{fn.__name__}.json")
            prof.export_chrome_trace(path_)
            traced[fn.__name__] = timeline(path_)
    hidden = max(0.0, min(1.0, (t_load + t_comp - t_over) / t_load))
    path.close()
    saver.close()
    arena_map.close()
    save_map.close()
    return {"cached": cached, "new": new, "kv_gb": kv_bytes / 1e9, "ceiling_ms": t_ceil * 1e3,
            "ceiling_gbs": kv_bytes / t_ceil / 1e9, "load_ms": t_load * 1e3,
            "load_gbs": kv_bytes / t_load / 1e9, "load_pct_ceiling": 100 * t_ceil / t_load,
            "save_gbs": kv_bytes / t_save / 1e9, "save_pct_ceiling": 100 * t_ceil / t_save,
            "compute_ms": t_comp * 1e3, "overlap_ms": t_over * 1e3, "hidden_pct": 100 * hidden,
            "batches": host["batches"], "load_host_ms": load_host * 1e3, "save_host_ms": save_host * 1e3,
            "timeline": traced}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cached", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--new", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the same code (slow)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--geometry", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    ap.add_argument("--codec", nargs="+", default=["raw"], choices=["raw", "int8"],
                    help="int8: half the bytes over the link; the ceiling stays the raw bytes' copy")
    ap.add_argument("--profile", metavar="FILE", help="cProfile the host's part of one load and one save "
                    "per case; a summary goes to FILE")
    ap.add_argument("--timeline", metavar="DIR", help="trace one ceiling, load, save and overlap per case "
                    "(torch.profiler; chrome traces into DIR) and print where each one's time went")
    args = ap.parse_args()
    profile = cProfile.Profile() if args.profile else None
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"{name}; objects of {CHUNK_TOKENS} tokens, bf16, checksums on")
    cols = ("geometry", "codec", "cached", "new", "kv_gb", "ceiling_gbs", "load_gbs", "load_pct_ceiling",
            "save_gbs", "save_pct_ceiling", "load_ms", "compute_ms", "overlap_ms", "hidden_pct", "batches",
            "load_host_ms", "save_host_ms")
    print(" ".join(f"{c:>16}" for c in cols))
    rows = []
    for geometry in args.geometry:
        use(geometry)
        for codec, cached, new in itertools.product(args.codec, args.cached, args.new):
            trace_dir = os.path.join(args.timeline, geometry.replace("/", "_")) if args.timeline else None
            if trace_dir:
                os.makedirs(trace_dir, exist_ok=True)
            r = {"geometry": geometry, "codec": codec, **run_case(cached, new, args.reps, args.device, codec,
                                                                     profile, trace_dir)}
            rows.append(r)
            print(" ".join(f"{r[c]:>16.2f}" if isinstance(r[c], float) else f"{r[c]:>16}" for c in cols),
                  flush=True)
            for fn, t in r["timeline"].items():
                print(f"  {fn:>10}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in t.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "rows": rows}, f, indent=1)
    if profile is not None:
        with open(args.profile, "w") as f:
            stats = pstats.Stats(profile, stream=f).strip_dirs()
            for key in ("tottime", "cumulative"):
                stats.sort_stats(key).print_stats(40)


if __name__ == "__main__":
    main()
