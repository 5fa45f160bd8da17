"""What the model fingerprint (ascend_store/common/fingerprint.py) costs at engine start.

Builds a safetensors checkpoint of a 7B geometry with random bf16 weights, sharded and
indexed as on the hub (Qwen2.5-7B: 4 shards, 339 tensors, 15.2 GB), then times the
fingerprint the scheduler and each worker compute at start (config and weights):
- cold: the checkpoint's pages evicted from the page cache first (``posix_fadvise``
  DONTNEED on each file after a sync; ``--drop-caches`` drops the whole page cache instead,
  as root),
- warm: the pages cached, the fingerprint computed anew,
- cached: the second half of one process (the worker after the scheduler): no reads.

    python benchmarks/fingerprint.py [--geometry qwen2.5-7b|llama-2-7b|tiny] [--dir DIR]
                                     [--trials 5] [--keep] [--drop-caches] [--json OUT]

The checkpoint is deleted afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from types import SimpleNamespace

import numpy as np

from ascend_store.common import fingerprint

# name: (vocab, hidden, intermediate, layers, heads, kv heads, qkv bias, shards)
GEOMETRIES = {
    "qwen2.5-7b": (152064, 3584, 18944, 28, 28, 4, True, 4),
    "llama-2-7b": (32000, 4096, 11008, 32, 32, 32, False, 2),
    "tiny": (512, 128, 256, 2, 4, 2, True, 2),  # for tests/unit/test_fingerprint.py
}
CHUNK = 64 << 20


def tensors(geometry: str) -> list[tuple[str, tuple[int, ...]]]:
    vocab, hidden, inter, layers, heads, kv_heads, bias, _ = GEOMETRIES[geometry]
    kv = hidden // heads * kv_heads
    out = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q", hidden), ("k", kv), ("v", kv)):
            out.append((f"{p}self_attn.{proj}_proj.weight", (rows, hidden)))
            if bias:
                out.append((f"{p}self_attn.{proj}_proj.bias", (rows,)))
        out += [(f"{p}self_attn.o_proj.weight", (hidden, hidden)),
                (f"{p}mlp.gate_proj.weight", (inter, hidden)), (f"{p}mlp.up_proj.weight", (inter, hidden)),
                (f"{p}mlp.down_proj.weight", (hidden, inter)), (f"{p}input_layernorm.weight", (hidden,)),
                (f"{p}post_attention_layernorm.weight", (hidden,))]
    return out + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def build(directory: str, geometry: str) -> int:
    """Write the checkpoint (random bytes as bf16 values, streamed: no 15 GB in memory);
    returns its size in bytes."""
    vocab, hidden, inter, layers, heads, kv_heads, _, shards = GEOMETRIES[geometry]
    items = tensors(geometry)
    sizes = [int(np.prod(shape)) * 2 for _, shape in items]
    per_shard, total = sum(sizes) / shards, 0
    groups: list[list[int]] = [[] for _ in range(shards)]
    acc = 0
    for i, size in enumerate(sizes):  # contiguous runs of about equal bytes, like the hub's shards
        groups[min(int(acc // per_shard), shards - 1)].append(i)
        acc += size
    rng, weight_map = np.random.default_rng(0), {}
    for s, group in enumerate(groups):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i in group:
            header[items[i][0]] = {"dtype": "BF16", "shape": list(items[i][1]),
                                   "data_offsets": [offset, offset + sizes[i]]}
            offset += sizes[i]
            weight_map[items[i][0]] = name
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(os.path.join(directory, name), "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            left = offset
            while left:
                f.write(rng.bytes(min(CHUNK, left)))
                left -= min(CHUNK, left)
            f.flush()
            os.fsync(f.fileno())
        total += 8 + len(blob) + offset
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f)
    from transformers import Qwen2Config

    Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, torch_dtype="bfloat16",
                tie_word_embeddings=False).save_pretrained(directory)
    return total


def evict(directory: str, drop_caches: bool) -> int:
    """Evict the checkpoint's pages; returns the bytes still resident (fincore), or -1."""
    os.sync()
    files = [os.path.join(directory, n) for n in sorted(os.listdir(directory))]
    if drop_caches:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    else:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    if not shutil.which("fincore"):
        return -1
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(v) for v in out.split())


def timed(vllm_config, clear: bool) -> tuple[float, fingerprint.ModelFingerprint]:
    if clear:
        fingerprint._cache.clear()
    t0 = time.perf_counter()
    fp = fingerprint.model_fingerprint(vllm_config)
    return (time.perf_counter() - t0) * 1e3, fp


def summary(ms: list[float]) -> dict:
    return {"median": round(statistics.median(ms), 2), "max": round(max(ms), 2),
            "trials": [round(v, 2) for v in ms]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen2.5-7b")
    ap.add_argument("--dir", default=None, help="where to build it (default: a new temporary directory)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--drop-caches", action="store_true", help="drop the whole page cache (root)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="fingerprint-bench-")
    os.makedirs(directory, exist_ok=True)
    try:
        t0 = time.perf_counter()
        size = build(directory, args.geometry)
        print(f"built {args.geometry}: {size / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s, {directory}")
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(directory)
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=directory, revision=None, hf_config=hf, hf_text_config=hf),
            load_config=SimpleNamespace(load_format="auto", download_dir=None))
        cold, resident = [], []
        for _ in range(args.trials):
            resident.append(evict(directory, args.drop_caches))
            cold.append(timed(vllm_config, True)[0])
        warm = [timed(vllm_config, True)[0] for _ in range(args.trials)]
        cached = [timed(vllm_config, False)[0] for _ in range(args.trials)]
        fp = timed(vllm_config, False)[1]
        result = {
            "geometry": args.geometry, "checkpoint_bytes": size, "files": fp.files,
            "tensors": len(tensors(args.geometry)), "bytes_read": fp.bytes_read,
            "cold_ms": summary(cold), "warm_ms": summary(warm), "cached_ms": summary(cached),
            "cold_method": ("drop_caches" if args.drop_caches else "posix_fadvise DONTNEED per file")
            + ", after sync", "resident_bytes_before_cold": resident,
            "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
        }
        print(json.dumps(result, indent=1))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
                f.write("\n")
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
