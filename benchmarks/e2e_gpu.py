"""Time to first token on a GPU: pool hits against recompute and the peers.

For a random-weight Llama of a given geometry (vLLM's dummy weights, the same in every
engine), prompts of 4K/16K/32K random tokens, ``max_tokens=1``, each configuration in a
fresh engine process: recompute (no connector, prefix caching off), device-hit (vLLM's
device prefix cache kept: the floor of any hit), native (vLLM's CPU offloading), lmcache
(LMCacheConnectorV1, local CPU backend; wrong KV on vLLM >= 0.26, see lmcache-mp),
lmcache-mp (LMCache's multi-process mode: its ZMQ cache server beside the engine, its L1 in
host memory) and ascend-* (this connector on the embedded pool,
layerwise on/off, codec raw/int8). All but recompute run with vLLM's prefix caching on, as
users run it, reset before each repetition where the hit must come from host memory.
Each prompt is sent once to fill the cache, once more untimed (warm-up), then timed over
``--reps`` repetitions (median and p90; every repetition kept in the JSON).
``--decode 64`` adds the time per output token of 64-token decodes, 1 and 16 requests at
once (what vLLM's CUDA graph mode changes). ``--concurrent 16`` adds 16 requests at once
sharing 90% of a prompt already sent (TTFT p50/p90, requests per second). The first
sampled token of every configuration is compared with recompute's. The link floor is the
prompt's KV bytes over the pinned-copy bandwidth measured here. Fresh engines of one
configuration differ more than the repetitions inside one engine: ``--rounds 3`` runs
every configuration three times round robin, each in a fresh engine, and pools every
repetition of every round (``--tag r4`` in a later call adds a round; ``--merge`` pools
them).

Needs vLLM (on the GPU machine: the offline kit of ../shared/gpu-kit) and, for lmcache,
LMCache 0.5.3:  python benchmarks/e2e_gpu.py --geometry 1b 7b --json out.json
Tables and a PNG from saved results (later files win per configuration), anywhere:
    python benchmarks/e2e_gpu.py --merge a.json b.json --plot e2e.png
``--trace`` loads ``hook_trace.py`` as a vLLM plugin in every engine process and keeps,
per timed hit, the engine core's steps, scheduler calls, calls into the worker, the wait
for the sampled token and every connector hook on one clock with the request's send and
receive (JSON; a median timeline is printed; the concurrent burst is one window, summed
per event), the engine core in its own process or, with
``--inprocess``, on the caller's thread. ``--profile DIR`` runs in one process and writes
a cProfile summary of the timed repetitions per prompt length to DIR. In-process TTFTs
lack the IPC and, with ``--profile``, carry the profiler's overhead: compare
configurations, not these numbers with the table's. ``--check`` exits 1 when a
configuration failed or any hit's first token is not recompute's (``make gpu-test``).
``--graphs`` runs vLLM with its CUDA
graphs (its default) instead of eager; ``--scrub`` overwrites the KV cache with a constant
after every prefix cache reset, so a hit's first token can come only from its load (a
reset frees blocks without clearing them: the prompt's own KV would still be there).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# name: (layers, hidden, heads, kv heads, head dim, ffn)
GEOMETRIES = {"1b": (16, 2048, 32, 8, 64, 8192), "7b": (28, 3584, 28, 4, 128, 18944),
              "tiny": (2, 256, 4, 2, 64, 512),  # tiny: a smoke run of this script on CPU
              # Qwen3-Next hybrids: one full-attention layer in 4, the others Gated-DeltaNet
              # (recurrent state); hybrid-7b has the 7B's attention and width.
              "hybrid-tiny": (4, 256, 4, 2, 64, 512), "hybrid-7b": (28, 3584, 28, 4, 128, 18944)}
FULL_ATTENTION_EVERY = 4  # a hybrid geometry's KV layers: every 4th (Qwen3-Next's interval)
ROUND = re.compile(r"(.+?)[@-]r\d+")  # a round's key: what it pools into, then @r1 or -r1
ASCEND = {"kv_connector": "AscendStoreConnector", "kv_connector_module_path": "ascend_store.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
CONFIGS = {
    "recompute": {},
    # vLLM's own device prefix cache, not reset: the floor any connector's hit can reach
    "device-hit": {"engine": {"enable_prefix_caching": True}},
    "native": {"engine": {"enable_prefix_caching": True, "kv_offloading_size": 16,
                          "kv_offloading_backend": "native"}, "reset": True},
    "lmcache": {"engine": {"enable_prefix_caching": True}, "reset": True,
                "kv": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
                "env": {"LMCACHE_LOCAL_CPU": "True", "LMCACHE_CHUNK_SIZE": "256",
                        "LMCACHE_MAX_LOCAL_CPU_SIZE": "20", "PYTHONHASHSEED": "0"}},
    # LMCache's multi-process mode: its in-process connector (lmcache) corrupts the KV of
    # vLLM >= 0.26's packed K/V cache layout (LMCache issue #4463), which reports this mode
    # unaffected. It frees a request's blocks a few steps after the request ends, so reset()
    # waits for them. The cache server runs beside the engine, on loopback (start_server).
    "lmcache-mp": {"engine": {"enable_prefix_caching": True}, "reset": True,
                   "kv": {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                        "lmcache.mp.port": 5555}},
                   "server": ["lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", "5555",
                              "--chunk-size", "256", "--l1-size-gb", "20", "--eviction-policy", "LRU",
                              "--disable-observability"]},
    "ascend-layerwise-raw": {"engine": {"enable_prefix_caching": True}, "reset": True,
        "kv": {**ASCEND, "kv_connector_extra_config": {"use_layerwise": True}}},
    "ascend-layerwise-raw-w4": {"engine": {"enable_prefix_caching": True}, "reset": True,
        "kv": {**ASCEND, "kv_connector_extra_config": {"use_layerwise": True, "load_window": 4}}},
    # Layerwise, but a hit of 8K tokens or more loads off the step (async_loads.py).
    "ascend-layerwise-raw-async": {"engine": {"enable_prefix_caching": True}, "reset": True,
        "kv": {**ASCEND, "kv_connector_extra_config": {"use_layerwise": True,
                                                       "async_load_min_tokens": 8192}}},
    "ascend-whole-raw": {"engine": {"enable_prefix_caching": True}, "reset": True,
        "kv": {**ASCEND, "kv_connector_extra_config": {"use_layerwise": False}}},
    "ascend-layerwise-int8": {"engine": {"enable_prefix_caching": True}, "reset": True,
        "kv": {**ASCEND, "kv_connector_extra_config": {
        "use_layerwise": True, "codec": "int8"}}},
}


def kv_layers(geometry: str) -> int:
    """The layers that hold KV cache (a hybrid's GDN layers hold state instead)."""
    layers = GEOMETRIES[geometry][0]
    return layers // FULL_ATTENTION_EVERY if geometry.startswith("hybrid") else layers


def floor_ms(geometry: str, tokens: int, gbs: float) -> float:
    """The link floor: a prompt's KV bytes (bf16) over the pinned-copy bandwidth."""
    _, _, _, kv, hd, _ = GEOMETRIES[geometry]
    return tokens * 2 * kv_layers(geometry) * kv * hd * 2 / gbs / 1e6


def model_dir(geometry: str) -> str:
    """A config-only model directory (weights come from vLLM's dummy loader)."""
    layers, hidden, heads, kv, hd, ffn = GEOMETRIES[geometry]
    path = os.path.join(tempfile.gettempdir(), f"ascend-e2e-{geometry}")
    os.makedirs(path, exist_ok=True)
    if geometry.startswith("hybrid"):
        from transformers import Qwen3NextConfig

        # Small MoE blocks (vLLM's Qwen3-Next needs them): the MLP is not what is measured.
        cfg = Qwen3NextConfig(
            vocab_size=32000, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
            full_attention_interval=FULL_ATTENTION_EVERY, linear_conv_kernel_dim=4,
            linear_key_head_dim=hd, linear_value_head_dim=hd, linear_num_key_heads=heads // 2,
            linear_num_value_heads=heads, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=ffn // 8, shared_expert_intermediate_size=ffn // 8,
            max_position_embeddings=40960, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False)
        cfg.architectures = ["Qwen3NextForCausalLM"]
        cfg.to_json_file(os.path.join(path, "config.json"))
        return path
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "vocab_size": 32000, "max_position_embeddings": 40960,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 1,
           "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def make_engine(spec: dict):
    """The engine of ``spec``'s configuration (its cache server started first): (LLM, config)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    conf = CONFIGS[spec["config"]]
    kwargs = dict(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                  max_model_len=max(spec["tokens"] + [spec.get("concurrent_tokens", 0)]) + 64,
                  enforce_eager=not spec.get("graphs"), seed=0,
                  enable_prefix_caching=False, max_num_batched_tokens=8192, disable_log_stats=False)
    if spec.get("gpu", True):
        kwargs.update(gpu_memory_utilization=0.8, attention_backend="FLASH_ATTN")
        if "hybrid" in os.path.basename(spec["model"]):
            # vLLM 0.26's default on Hopper, FlashInfer's GDN prefill (compiled at first use),
            # killed the tiny hybrid's engine in its first request on an H100: Triton's (FLA).
            kwargs["gdn_prefill_backend"] = "triton"
    else:  # the CPU smoke run
        kwargs.update(distributed_executor_backend="uni", block_size=128)
    if spec.get("graphs"):  # the timed hits compute one token: small batches are all it needs
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
        if spec.get("cudagraph_mode"):  # e.g. PIECEWISE: vLLM's forward without full graphs
            kwargs["compilation_config"]["cudagraph_mode"] = spec["cudagraph_mode"]
    kwargs.update(conf.get("engine", {}))
    kwargs.update(spec.get("engine_args") or {})
    if conf.get("kv"):
        kv = dict(conf["kv"])
        if kv.get("kv_connector") == "AscendStoreConnector":
            extra = dict(kv.get("kv_connector_extra_config", {}))
            extra["local"] = {"socket": os.path.join(spec["tmp"], "pool.sock"),
                              "capacity": "24GiB" if spec.get("gpu", True) else "2GiB"}
            kv["kv_connector_extra_config"] = extra
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv)
    start_server(conf.get("server"), os.path.join(spec["tmp"], f"{spec['name']}-server.log"))
    llm = LLM(**kwargs)
    if spec.get("spread_weights"):
        llm.collective_rpc(spread_weights)
    return llm, conf


def child(spec: dict) -> None:
    """One engine, one configuration: prints a RESULT line."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, conf = make_engine(spec)
    kv_connector = conf.get("kv", {}).get("kv_connector")
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    out = {"cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)}
    for n in spec["tokens"]:
        rng = random.Random(n)
        prompt = TokensPrompt(prompt_token_ids=[rng.randrange(3, 32000) for _ in range(n)])
        first = llm.generate([prompt], params, use_tqdm=False)[0]  # computes; fills the cache
        time.sleep(1.0)  # a save still draining would turn the first timed hit into a miss
        times, tokens, cached, windows = [], [], [], []
        prof = cProfile.Profile() if spec.get("profile") else None
        for rep in range(spec["reps"] + 1):  # the first is a warm-up
            reset(llm, spec, conf)
            if prof and rep:
                prof.enable()
            t0 = time.perf_counter()
            o = llm.generate([prompt], params, use_tqdm=False)[0]
            t1 = time.perf_counter()
            if prof and rep:
                prof.disable()
            if rep == 0:
                continue
            times.append(t1 - t0)
            windows.append((t0, t1))
            tokens.append(o.outputs[0].token_ids[0])
            cached.append(o.num_cached_tokens or 0)
        ranked = sorted(times)
        p90 = ranked[min(len(ranked) - 1, int(0.9 * len(ranked)))]
        out[n] = {"ttft_ms": ranked[len(ranked) // 2] * 1e3, "p90_ms": p90 * 1e3,
                  "all_ms": [t * 1e3 for t in times],
                  "token": tokens, "first_token": first.outputs[0].token_ids[0], "cached": cached}
        if spec.get("trace"):
            import hook_trace

            time.sleep(0.2)  # the engine core's last step flushes its events
            out[n]["trace"] = hook_trace.timelines(spec["trace"], windows)
            if os.environ.get(hook_trace.SAMPLE):
                out[n]["samples"] = hook_trace.samples(spec["trace"], windows)
        if spec.get("greedy"):  # one more hit (after a reset and scrub), decoding on
            reset(llm, spec, conf)
            many = SamplingParams(temperature=0.0, max_tokens=spec["greedy"], ignore_eos=True,
                                  detokenize=False)
            out[n]["greedy"] = list(llm.generate([prompt], many, use_tqdm=False)[0].outputs[0].token_ids)
        if prof:
            write_profile(prof, os.path.join(spec["profile"], f"{spec['name']}-{n // 1024}K.txt"),
                          spec["reps"])
    if spec.get("decode"):
        out["decode"] = decode(llm, spec)
    if spec.get("concurrent"):
        try:
            out["concurrent"] = concurrent(llm, spec, conf, params)
        except Exception as exc:  # keep the single-request results if this vLLM differs
            out["concurrent_error"] = repr(exc)
    out["reset_retries"] = RESETS["retries"]
    if spec.get("scrub") and kv_connector == "AscendStoreConnector":  # (--scrub allows the callable)
        out["worker_counters"] = llm.collective_rpc(worker_counters)[0]
    print("RESULT " + json.dumps(out), flush=True)


def start_server(argv: list[str] | None, log_path: str) -> None:
    """A configuration's cache server (``python -m MODULE ...``), once it accepts connections;
    it gets SIGTERM when this engine process ends (exit, or a timeout's kill)."""
    if not argv:
        return
    import atexit
    import ctypes
    import signal
    import socket

    libc = ctypes.CDLL(None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=log,
                                stderr=subprocess.STDOUT,
                                preexec_fn=lambda: libc.prctl(1, signal.SIGTERM))  # PR_SET_PDEATHSIG
    atexit.register(proc.terminate)
    port, deadline = int(argv[argv.index("--port") + 1]), time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"cache server exited ({proc.returncode}): {open(log_path).read()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"cache server not listening after 300 s: {open(log_path).read()[-3000:]}")


def scrub_kv_caches(worker) -> int:
    """Run in each worker (``collective_rpc``; the CPU engine tests call it too): overwrite
    every floating-point KV cache and state tensor with a constant, and return how many. A
    constant, not random values: ``normal_`` over the CPU tests' 1 GiB cache takes ~1.7 s
    on 2 cores, ``fill_`` 0.07 s; either makes a load that never landed give other tokens."""
    import torch

    def tensors(x):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            for y in x:
                yield from tensors(y)

    n = 0
    for layer in worker.vllm_config.compilation_config.static_forward_context.values():
        for t in tensors(getattr(layer, "kv_cache", None)):
            if t.is_floating_point() and t.element_size() > 1:
                t.fill_(1.0)
                n += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return n


def spread_weights(worker) -> None:
    """Run in each worker: redraw every weight matrix from N(0, 1/fan-in), seeded by its
    name (the same in every engine). vLLM's dummy weights (uniform within 1e-3) make greedy
    tokens nearly independent of the prompt, so a hit that read wrong KV could still agree."""
    import zlib

    import torch

    for name, p in worker.model_runner.model.named_parameters():
        if p.dim() >= 2 and p.is_floating_point() and p.element_size() > 1:
            g = torch.Generator(device=p.device).manual_seed(zlib.crc32(name.encode()))
            with torch.no_grad():
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)


def worker_counters(worker) -> dict:
    """Run in each worker (``collective_rpc``; the CPU engine tests call it too): its
    connector's counters since it started ({} without a connector)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return dict(get_kv_transfer_group().worker.counters.total) if has_kv_transfer_group() else {}


RESETS = {"retries": 0}  # failed resets retried, in this engine's process


def reset(llm, spec: dict, conf: dict) -> None:
    """Before a timed hit of a configuration that resets: drop vLLM's prefix cache and, with
    ``--scrub``, overwrite every KV cache tensor, so the hit's first token can come only
    from what its load wrote (a block left from an earlier repetition of the same prompt
    would hide a forward that read before its load landed)."""
    if not conf.get("reset"):
        return
    # A connector may free a finished request's blocks only once its save has landed, a few
    # engine steps after generate() returns (LMCache's multi-process mode does so for every
    # request). A reset then fails, and the next "hit" would be vLLM's own device hit.
    deadline = time.monotonic() + 30
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache would not reset for 30 s: blocks still held")
        RESETS["retries"] += 1
        time.sleep(0.02)
    if not spec.get("scrub"):
        return
    if not all(llm.collective_rpc(scrub_kv_caches)):
        raise RuntimeError("--scrub found no KV cache tensor to fill")


def write_profile(prof: cProfile.Profile, path: str, reps: int) -> None:
    """The functions with the most cumulative and own time, per timed repetition."""
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).strip_dirs()
    for key in ("cumulative", "tottime"):
        buf.write(f"=== by {key} (ms are totals over {reps} repetitions) ===\n")
        stats.sort_stats(key).print_stats(45)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def concurrent(llm, spec: dict, conf: dict, params) -> dict:
    """``concurrent`` requests at once, sharing 90% of a prompt whose prefix was sent
    before (so it sits in the cache under test): TTFT p50/p90 and requests per second."""
    from vllm.inputs import TokensPrompt

    n, k = spec["concurrent_tokens"], spec["concurrent"]
    rng = random.Random(n + k)
    shared = [rng.randrange(3, 32000) for _ in range(int(0.9 * n))]
    tail = lambda: [rng.randrange(3, 32000) for _ in range(n - len(shared))]  # noqa: E731
    llm.generate([TokensPrompt(prompt_token_ids=shared + tail())], params, use_tqdm=False)
    time.sleep(1.0)
    reset(llm, spec, conf)
    prompts = [TokensPrompt(prompt_token_ids=shared + tail()) for _ in range(k)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttft = sorted(1e3 * o.metrics.first_token_latency for o in outs if o.metrics is not None)
    pick = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan")  # noqa: E731
    got = {"tokens": n, "requests": k, "ttft_p50_ms": pick(0.5), "ttft_p90_ms": pick(0.9),
           "req_per_s": k / wall, "cached": [o.num_cached_tokens or 0 for o in outs]}
    if spec.get("trace"):  # the burst as one window: every step of it
        import hook_trace

        time.sleep(0.2)
        window = [(t0, t0 + wall)]
        got["trace"] = hook_trace.timelines(spec["trace"], window)[0]
        if os.environ.get(hook_trace.SAMPLE):
            got["samples"] = hook_trace.samples(spec["trace"], window)
    return got


def decode(llm, spec: dict) -> dict:
    """Time per output token of 1 and of 16 requests decoding together from 512-token
    prompts the device cache holds (no reset): what vLLM's graph mode changes after a hit.
    Per batch: the median of 3 timed runs of ``--decode`` tokens less that of 1 token, over
    the tokens in between."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    n, rng, got = spec["decode"], random.Random(512), {}
    for batch in (1, 16):
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 32000) for _ in range(512)])
                   for _ in range(batch)]
        ms = {}
        for k in (1, n):
            params = SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True, detokenize=False)
            llm.generate(prompts, params, use_tqdm=False)  # warm-up (the first fills the cache)
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                runs.append((time.perf_counter() - t0) * 1e3)
            ms[k] = statistics.median(runs)
        got[str(batch)] = {"tpot_ms": (ms[n] - ms[1]) / (n - 1), "first_ms": ms[1], "all_ms": ms[n]}
    return got


def decode_line(d: dict) -> str:
    return "decode, time per output token: " + ", ".join(
        f"{b} at once {r['tpot_ms']:.2f} ms" for b, r in d.items())


def pool_rounds(results: dict) -> None:
    """Pools a configuration's rounds (``name@r1``.., ``name@tag-r1``..) into ``name``
    (``name@tag``): one median and p90 over all their repetitions, each round's median kept."""
    groups: dict[str, list[dict]] = {}
    for key, r in results["runs"].items():
        m = ROUND.fullmatch(key)
        if m and "error" not in r:
            groups.setdefault(m.group(1), []).append(r)
    for key, rs in groups.items():
        pooled: dict = {"rounds": len(rs)}
        for n in [k for k in rs[0] if k.isdigit() and all(k in r for r in rs)]:
            times = sorted(t for r in rs for t in r[n]["all_ms"])
            pooled[n] = {"ttft_ms": times[len(times) // 2],  # as one engine's: the upper median, and
                         "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],  # a p90 of 5 is the max
                         "all_ms": times, "round_ms": [r[n]["ttft_ms"] for r in rs],
                         "first_token": rs[0][n]["first_token"],
                         **{k: [x for r in rs for x in r[n][k]] for k in ("token", "cached")}}
        conc = [r["concurrent"] for r in rs if "concurrent" in r]
        if conc:
            keys = ("ttft_p50_ms", "ttft_p90_ms", "req_per_s")
            pooled["concurrent"] = {**conc[0], "rounds": conc, **{k: statistics.median(c[k] for c in conc)
                                                                   for k in keys}}
        dec = [r["decode"] for r in rs if "decode" in r]
        if dec:
            pooled["decode"] = {b: {"tpot_ms": statistics.median(d[b]["tpot_ms"] for d in dec),
                                    "round_ms": [d[b]["tpot_ms"] for d in dec]} for b in dec[0]}
        results["runs"][key] = pooled


def concurrent_line(c: dict) -> str:
    each = "/".join(f"{x['req_per_s']:.1f}" for x in c.get("rounds", []))
    return (f"{c['requests']} at once, {c['tokens']} tokens: TTFT p50 {c['ttft_p50_ms']:.0f} ms, "
            f"p90 {c['ttft_p90_ms']:.0f} ms, {c['req_per_s']:.2f} req/s"
            + (f" (rounds {each})" if each else ""))


def link_gbs() -> float:
    import torch

    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * src.numel() / (time.perf_counter() - t0) / 1e9


def same_token(r: dict, base: dict, tokens: list[int]) -> bool | str:
    """Whether every repetition's first token is recompute's, and with ``--greedy`` the
    decoded tokens too ("-": no recompute to compare)."""
    if not all(str(n) in base for n in tokens):
        return "-"
    return all(t == base[str(n)]["token"][0] for n in tokens for t in r[str(n)]["token"]) and all(
        r[str(n)].get("greedy") == base[str(n)].get("greedy") for n in tokens)


def report(results: dict, tokens: list[int]) -> None:
    """One table per geometry: median TTFT per prompt length, the link floor, and whether
    the first token matches recompute's."""
    gbs = results["link_gbs"]
    for geometry in sorted({k.split("/")[0] for k in results["runs"]}):
        runs = {k.split("/")[1]: r for k, r in results["runs"].items() if k.startswith(geometry + "/")}
        base = runs.get("recompute", {})
        print(f"{geometry}: TTFT ms " + " ".join(f"{n // 1024:>7}K" for n in tokens) + "   same token")
        for name, r in runs.items():
            if "error" in r or ROUND.fullmatch(name):  # shown pooled, with each round's median
                continue
            same = same_token(r, base, tokens)
            print(f"  {name:<22}" + " ".join(f"{r[str(n)]['ttft_ms']:8.1f}" for n in tokens) + f"   {same}")
            if all("p90_ms" in r[str(n)] for n in tokens):
                print(f"  {'  p90':<22}" + " ".join(f"{r[str(n)]['p90_ms']:8.1f}" for n in tokens))
            if all("round_ms" in r[str(n)] for n in tokens):
                print(f"  {'  rounds':<22}" + " ".join(
                    f"{'/'.join(f'{t:.0f}' for t in r[str(n)]['round_ms']):>8}" for n in tokens))
            if "concurrent" in r:
                print("    " + concurrent_line(r["concurrent"]))
            if "decode" in r:
                print("    " + decode_line(r["decode"]))
        floor = [floor_ms(geometry, n, gbs) for n in tokens]
        print(f"  {'link floor':<22}" + " ".join(f"{f:8.1f}" for f in floor))


def plot(results: dict, tokens: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geometries = sorted({k.split("/")[0] for k in results["runs"]})
    fig, axes = plt.subplots(1, len(geometries), figsize=(6 * len(geometries), 4), squeeze=False)
    for ax, geometry in zip(axes[0], geometries):
        for i, name in enumerate(CONFIGS):  # one colour per configuration in every panel
            r = results["runs"].get(f"{geometry}/{name}")
            if r is not None and "error" not in r:
                wrong = same_token(r, results["runs"].get(f"{geometry}/recompute", {}), tokens) is False
                ax.plot([n // 1024 for n in tokens], [r[str(n)]["ttft_ms"] for n in tokens],
                        "o:" if wrong else "o-", color=f"C{i}",
                        label=name + (" (not recompute's token)" if wrong else ""))
        ax.plot([n // 1024 for n in tokens], [floor_ms(geometry, n, results["link_gbs"]) for n in tokens],
                "k--", label="link floor")
        ax.set(title=f"{geometry}: TTFT of a full prefix hit", xlabel="prompt (K tokens)", ylabel="ms",
               yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", nargs="+", default=["1b"], choices=list(GEOMETRIES))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--concurrent", type=int, default=0,
                    help="also run this many requests at once sharing 90%% of a prompt")
    ap.add_argument("--concurrent-tokens", type=int, default=16384)
    ap.add_argument("--decode", type=int, default=0, metavar="N",
                    help="also time N-token decodes of 1 and 16 requests (time per output token)")
    ap.add_argument("--json")
    ap.add_argument("--plot", help="write a PNG of TTFT against prompt length")
    ap.add_argument("--merge", nargs="+", help="report saved results instead of running")
    ap.add_argument("--profile", help="write cProfile summaries of the timed hits to this directory")
    ap.add_argument("--trace", action="store_true",
                    help="record where each timed hit's time goes in every engine process")
    ap.add_argument("--inprocess", action="store_true", help="run the engine core on the caller's thread")
    ap.add_argument("--env", nargs="+", default=[], metavar="KEY=VALUE",
                    help="set in every engine's environment (e.g. VLLM_USE_V2_MODEL_RUNNER=0)")
    ap.add_argument("--tag", help="suffix of the configurations' names in the results (name@tag); "
                    "a tag r<N> makes the run a round of that configuration (see --rounds)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times round robin, each in a fresh engine, "
                         "and pool the rounds (name@r1.. and the pooled name)")
    ap.add_argument("--graphs", action="store_true",
                    help="vLLM's CUDA graphs (its default; a connector may ask for PIECEWISE), not eager")
    ap.add_argument("--cudagraph-mode", help="with --graphs: vLLM's cudagraph_mode (default: its own)")
    ap.add_argument("--engine-args", type=json.loads, default={}, metavar="JSON",
                    help="more LLM() arguments for every configuration, e.g. "
                         "'{\"attention_config\": {\"flash_attn_max_num_splits_for_cuda_graph\": 128}}'")
    ap.add_argument("--scrub", action="store_true",
                    help="overwrite the KV cache (a constant) after each prefix cache reset")
    ap.add_argument("--package", help="import ascend_store from this checkout (an A/B of the connector)")
    ap.add_argument("--greedy", type=int, default=0, metavar="N",
                    help="after the timed hits, one more decoding N greedy tokens, compared with recompute's")
    ap.add_argument("--spread-weights", action="store_true",
                    help="redraw the dummy weights so that greedy tokens depend on the prompt")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when a configuration failed or a hit's first token is not recompute's")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.merge:
        results = {"runs": {}}
        for path in args.merge:
            with open(path) as f:
                saved = json.load(f)
            results["link_gbs"] = saved["link_gbs"]
            results["runs"].update(saved["runs"])
        pool_rounds(results)
        report(results, args.tokens)
        if args.plot:
            plot(results, args.tokens, args.plot)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return
    gbs = link_gbs()
    print(f"pinned host->device copy: {gbs:.1f} GB/s", flush=True)
    results = {"link_gbs": gbs, "runs": {}}
    rounds = ([f"{args.tag}-r{i + 1}" if args.tag else f"r{i + 1}" for i in range(args.rounds)]
              if args.rounds > 1 else [args.tag])
    for geometry, tag, name in [(g, t, c) for g in args.geometry for t in rounds for c in args.configs]:
        tmp = tempfile.mkdtemp(prefix="ascend-e2e-")
        spec = {"config": name, "model": model_dir(geometry), "tokens": args.tokens, "reps": args.reps,
                "tmp": tmp, "gpu": gbs == gbs, "concurrent": args.concurrent,
                "concurrent_tokens": args.concurrent_tokens, "decode": args.decode,
                "name": f"{geometry}-{name}",
                "profile": args.profile and os.path.abspath(args.profile),
                "trace": args.trace and os.path.join(tmp, "trace"), "graphs": args.graphs,
                "scrub": args.scrub, "cudagraph_mode": args.cudagraph_mode, "greedy": args.greedy,
                "spread_weights": args.spread_weights,
                "engine_args": args.engine_args}
        path = [os.path.abspath(args.package or REPO), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, **CONFIGS[name].get("env", {}), **dict(e.split("=", 1) for e in args.env)}
        if args.trace:
            import hook_trace

            os.makedirs(spec["trace"])
            path += [HERE, hook_trace.plugin_path(os.path.join(tmp, "plugin"))]
            env[hook_trace.ENV] = spec["trace"]
        env["PYTHONPATH"] = os.pathsep.join(path)
        if args.inprocess or args.profile:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if args.scrub or args.spread_weights:  # collective_rpc sends these functions pickled
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        t0 = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                                  capture_output=True, text=True, timeout=args.timeout)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            # The root cause of an engine's death is often far above the tail of its traceback.
            causes = [ln for ln in proc.stderr.splitlines() if re.search(r"Error|Exception|error:", ln)]
            got = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-3000:],
                                                           "causes": causes[:40]}
            # The engine's own log (which copy path the connector took, warnings).
            got["log"] = [ln for ln in proc.stderr.splitlines() if "ascend" in ln.lower()][-40:]
        except subprocess.TimeoutExpired as exc:
            got = {"error": f"timeout after {args.timeout}s: {(exc.stderr or b'')[-2000:]!r}"}
        got["wall_s"] = time.perf_counter() - t0
        results["runs"][f"{geometry}/{name}" + (f"@{tag}" if tag else "")] = got
        if "error" in got:
            print(f"{geometry:>3} {name:<22} FAILED: {got['error'][-1500:]}", flush=True)
            print("    error lines:\n      " + "\n      ".join(got.get("causes", [])), flush=True)
        else:
            cells = " ".join(f"{n // 1024}K {got[str(n)]['ttft_ms']:7.1f} ms "
                             f"(hit {got[str(n)]['cached'][0]})" for n in args.tokens)
            copies = got.get("worker_counters", {}).get("deferred_state_copies")
            print(f"{geometry:>3} {name:<22} {cells} [{got['cudagraph_mode']}]"
                  + (f" deferred state copies {copies}" if copies is not None else ""), flush=True)
            for n in args.tokens:
                if "trace" in got[str(n)]:
                    import hook_trace

                    print(f"    {n // 1024}K, median over the timed hits:\n      "
                          + "\n      ".join(hook_trace.summary(got[str(n)]["trace"])), flush=True)
                    for stack, count in got[str(n)].get("samples", [])[:12]:
                        print(f"      {count:5d}  {stack[:160]}", flush=True)
            if "decode" in got:
                print(f"{'':>3} {'':<22} " + decode_line(got["decode"]), flush=True)
            if "concurrent" in got:
                print(f"{'':>3} {'':<22} " + concurrent_line(got["concurrent"]), flush=True)
                if "trace" in got["concurrent"]:
                    import hook_trace

                    rows = hook_trace.totals(got["concurrent"]["trace"])
                    print("      " + "\n      ".join(rows), flush=True)
        pool_rounds(results)  # the rounds so far (the last pass pools them all)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    report(results, args.tokens)
    if args.plot:
        plot(results, args.tokens, args.plot)
    if args.check:
        bad = [k for k, r in results["runs"].items() if "error" in r or same_token(
            r, results["runs"].get(k.split("/")[0] + "/recompute", {}), args.tokens) is False]
        if bad:
            sys.exit(f"check failed: {', '.join(bad)} (an error, or not recompute's first token)")


if __name__ == "__main__":
    main()
