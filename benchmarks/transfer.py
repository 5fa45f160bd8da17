"""Per-layer KV save/load bandwidth between a paged GPU cache and the pool's host memory.

Runs with torch, triton and this package only (no vLLM). For each geometry and prompt
length it measures, in the same run:
  ceiling  one contiguous pinned copy of the same bytes (the link's practical limit)
  naive    one copy_ per block segment into its object slot (what a simple connector does)
  gather   index_select into a device staging buffer, then one contiguous copy
           (fast, but lands in a staging layout, not in the objects)
  direct   ascend_store.device.kernels.copy_segments: one Triton kernel per layer reading the
           cache and writing each block straight into its object slot of the
           pinned arena (headers in between untouched), and the reverse for loads
  staged   the same kernel builds the layer's objects in device memory, then one DMA
           moves them to (or from) the arena: possible when the layer's objects are
           back to back there
Every layer is timed back to back over all layers with CUDA events; GB/s counts KV
bytes only. The arena is a shared-memory mapping registered with cudaHostRegister, like
the local pool's.

    python benchmarks/transfer.py [--tokens 1024 4096 16384 65536] [--plot transfer.png]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ascend_store.device.kernels import WORD, tl, triton  # noqa: E402
from ascend_store.device.platform import Device  # noqa: E402


# The zero-copy variant this benchmark compares (the worker no longer uses it): a Triton
# kernel reading or writing the pinned arena directly over the link.
@triton.jit
def _copy_segments_kernel(src, dst, src_offs, dst_offs, seg_words, BLOCK: tl.constexpr):
    seg = tl.program_id(0)
    part = tl.program_id(1)
    s = tl.load(src_offs + seg)
    d = tl.load(dst_offs + seg)
    idx = part * BLOCK + tl.arange(0, BLOCK)
    mask = idx < seg_words
    tl.store(dst + d + idx, tl.load(src + s + idx, mask=mask), mask=mask)


class HostPtr:
    """Lets a Triton kernel take a raw (registered) host address as an int64 pointer."""

    dtype = torch.int64

    def __init__(self, addr: int):
        self.addr = addr

    def data_ptr(self) -> int:
        return self.addr


def copy_segments(src, dst, src_offs: torch.Tensor, dst_offs: torch.Tensor, seg_words: int,
                  block: int = 1024, num_warps: int = 4) -> None:
    """Copy ``len(src_offs)`` segments of ``seg_words`` words (int64 tensors or HostPtrs)."""
    n = src_offs.numel()
    if n:
        grid = (n, triton.cdiv(seg_words, block))
        _copy_segments_kernel[grid](src, dst, src_offs, dst_offs, seg_words, BLOCK=block,
                                    num_warps=num_warps)


GEOMETRIES = {  # name: (layers, kv heads, head dim, block size)
    "llama3-8b/b16": (32, 8, 128, 16),
    "qwen2.5-7b/b128": (28, 4, 128, 128),
}
HEADER = 32
ALIGN = 512


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def timed(fn, reps: int = 3) -> float:
    """Median seconds of ``fn`` (which queues GPU work) over ``reps`` runs."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def run_geometry(name, geom, token_counts, dev, cfg, tune=False):
    """Measure every path; with ``tune``, first try kernel block/warp choices and keep the
    fastest in ``cfg`` ({"save": (block, warps), "load": ...})."""
    layers, heads, dim, bs = geom
    seg_bytes = bs * heads * dim * 2  # one block's K (or V) in bf16
    max_blocks = max(token_counts) // bs
    num_blocks = max_blocks + 64
    obj_bytes = aligned(HEADER + 2 * seg_bytes)
    caches = [torch.randn(2, num_blocks, bs, heads, dim, device="cuda", dtype=torch.bfloat16)
              for _ in range(layers)]
    arena_bytes = layers * max_blocks * obj_bytes
    arena = mmap.mmap(-1, arena_bytes, mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    dev.pin(arena)
    host = torch.frombuffer(arena, dtype=torch.uint8)
    base = host.data_ptr()
    # Contiguous pinned buffers for the ceiling and the gather path.
    layer_bytes = 2 * max_blocks * seg_bytes
    pinned = torch.empty(layer_bytes, dtype=torch.uint8, pin_memory=True)
    dev_contig = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda")
    rows = []
    for tokens in token_counts:
        n = tokens // bs
        ids = torch.randperm(num_blocks, device="cuda")[:n]
        ids_cpu = ids.tolist()
        kv_bytes = layers * 2 * n * seg_bytes
        words = seg_bytes // WORD
        # Segment plan of one layer: K and V of each block; objects of layer l follow layer l-1.
        src_offs = torch.stack([ids * bs * heads * dim * 2 // WORD,
                                (num_blocks + ids) * bs * heads * dim * 2 // WORD], 1).flatten()
        obj = torch.arange(n, device="cuda") * (obj_bytes // WORD)
        dst_rel = torch.stack([obj + HEADER // WORD, obj + (HEADER + seg_bytes) // WORD], 1).flatten()
        dst_offs = [dst_rel + li * max_blocks * obj_bytes // WORD for li in range(layers)]
        nbytes = 2 * n * seg_bytes

        def ceiling_save():
            for _ in range(layers):
                pinned[:nbytes].copy_(dev_contig[:nbytes], non_blocking=True)

        def ceiling_load():
            for _ in range(layers):
                dev_contig[:nbytes].copy_(pinned[:nbytes], non_blocking=True)

        def naive_save():
            for li, c in enumerate(caches):
                o = li * max_blocks * obj_bytes
                for j, b in enumerate(ids_cpu):
                    for kv in (0, 1):
                        off = o + j * obj_bytes + HEADER + kv * seg_bytes
                        host[off:off + seg_bytes].view(torch.bfloat16).view(bs, heads, dim).copy_(
                            c[kv, b], non_blocking=True)

        def gather_save():
            for c in caches:
                g = c.index_select(1, ids)
                pinned[:nbytes].copy_(g.view(torch.uint8).flatten(), non_blocking=True)

        def direct_save():
            for li, c in enumerate(caches):
                copy_segments(c.view(torch.int64), HostPtr(base), src_offs, dst_offs[li], words,
                              *cfg["save"])

        def direct_load():
            for li, c in enumerate(caches):
                copy_segments(HostPtr(base), c.view(torch.int64), dst_offs[li], src_offs, words,
                              *cfg["load"])

        staging = torch.empty(n * obj_bytes // WORD, dtype=torch.int64, device="cuda")
        run = n * obj_bytes  # a layer's objects, back to back in the arena

        def staged_save():  # objects built on the device, then one DMA per layer
            for li, c in enumerate(caches):
                copy_segments(c.view(torch.int64), staging, src_offs, dst_rel, words, *cfg["save"])
                o = li * max_blocks * obj_bytes
                host[o:o + run].copy_(staging.view(torch.uint8), non_blocking=True)

        def staged_load():
            for li, c in enumerate(caches):
                o = li * max_blocks * obj_bytes
                staging.view(torch.uint8).copy_(host[o:o + run], non_blocking=True)
                copy_segments(staging, c.view(torch.int64), dst_rel, src_offs, words, *cfg["load"])

        if tune:
            for kind, fn in (("save", direct_save), ("load", direct_load)):
                results = []
                for c in ((512, 4), (1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
                    cfg[kind] = c
                    results.append((kv_bytes / timed(fn) / 1e9, c))
                    print(f"# tune {name} {tokens} {kind} block={c[0]} warps={c[1]}: "
                          f"{results[-1][0]:.1f} GB/s", flush=True)
                cfg[kind] = max(results)[1]

        # Correctness: what direct_save wrote is each block's bytes; direct_load restores them.
        direct_save()
        torch.cuda.synchronize()
        j, b = n // 2, ids_cpu[n // 2]
        off = 5 * max_blocks * obj_bytes + j * obj_bytes + HEADER
        got = host[off:off + seg_bytes].view(torch.bfloat16).view(bs, heads, dim)
        assert torch.equal(got, caches[5][0, b].cpu()), "direct save wrote wrong bytes"
        saved = caches[5][:, ids].clone()
        caches[5][:, ids] = 0
        direct_load()
        torch.cuda.synchronize()
        assert torch.equal(caches[5][:, ids], saved), "direct load restored wrong bytes"

        host[:run].zero_()
        staged_save()
        torch.cuda.synchronize()
        off0 = j * obj_bytes + HEADER
        got = host[off0:off0 + seg_bytes].view(torch.bfloat16).view(bs, heads, dim)
        assert torch.equal(got, caches[0][0, b].cpu()), "staged save wrote wrong bytes"
        ceil_s, ceil_l = timed(ceiling_save), timed(ceiling_load)
        res = {"geometry": name, "tokens": tokens, "kv_MiB": round(kv_bytes / 2**20, 1),
               "ceiling_save": kv_bytes / ceil_s / 1e9, "ceiling_load": kv_bytes / ceil_l / 1e9,
               "direct_save": kv_bytes / timed(direct_save) / 1e9,
               "direct_load": kv_bytes / timed(direct_load) / 1e9,
               "gather_save": kv_bytes / timed(gather_save) / 1e9,
               "staged_save": kv_bytes / timed(staged_save) / 1e9,
               "staged_load": kv_bytes / timed(staged_load) / 1e9}
        if tokens <= 16384:  # one launch per segment: slow enough to keep to smaller sizes
            res["naive_save"] = kv_bytes / timed(naive_save, reps=1) / 1e9
        res["direct_cfg"] = f"save {cfg['save']}, load {cfg['load']}"
        rows.append(res)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}),
              flush=True)
    caches.clear()  # free the GPU memory before the next geometry
    dev.unpin(arena)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--geometry", nargs="+", default=list(GEOMETRIES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    dev = Device(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    rows = []
    for g in args.geometry:
        cfg = {"save": (1024, 4), "load": (1024, 4)}
        run_geometry(g, GEOMETRIES[g], [16384], dev, cfg, tune=True)  # once per geometry
        rows += run_geometry(g, GEOMETRIES[g], args.tokens, dev, cfg)
    print(f"\n{'geometry':<18}{'tokens':>7}{'MiB':>8}  {'ceil save':>9}{'direct':>8}{'%':>5}"
          f"{'staged':>8}{'%':>5}{'gather':>8}{'naive':>7}  {'ceil load':>9}{'direct':>8}{'%':>5}"
          f"{'staged':>8}{'%':>5}")
    for r in rows:
        naive = f"{r['naive_save']:.1f}" if "naive_save" in r else "-"
        cs, cl = r["ceiling_save"], r["ceiling_load"]
        print(f"{r['geometry']:<18}{r['tokens']:>7}{r['kv_MiB']:>8}  {cs:>9.1f}"
              f"{r['direct_save']:>8.1f}{100 * r['direct_save'] / cs:>5.0f}"
              f"{r['staged_save']:>8.1f}{100 * r['staged_save'] / cs:>5.0f}"
              f"{r['gather_save']:>8.1f}{naive:>7}  {cl:>9.1f}{r['direct_load']:>8.1f}"
              f"{100 * r['direct_load'] / cl:>5.0f}{r['staged_load']:>8.1f}"
              f"{100 * r['staged_load'] / cl:>5.0f}")
    print("(GB/s of KV bytes; % = path / pinned ceiling measured in the same run)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for ax, kind in zip(axes, ("save", "load")):
            for g in args.geometry:
                rs = [r for r in rows if r["geometry"] == g]
                t = [r["tokens"] for r in rs]
                ax.plot(t, [r[f"ceiling_{kind}"] for r in rs], "k--", label=f"{g} pinned ceiling")
                ax.plot(t, [r[f"direct_{kind}"] for r in rs], "o-", label=f"{g} direct (Triton)")
                ax.plot(t, [r[f"staged_{kind}"] for r in rs], "^-", label=f"{g} staged (Triton + 1 DMA)")
                if kind == "save":
                    ax.plot(t, [r["gather_save"] for r in rs], "s:", label=f"{g} gather+copy")
                    nv = [r for r in rs if "naive_save" in r]
                    ax.plot([r["tokens"] for r in nv], [r["naive_save"] for r in nv], "x:",
                            label=f"{g} copy per block")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("prompt tokens")
            ax.set_title(f"{kind}, all layers")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("GB/s")
        for ax in axes:
            ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
