"""TTFT with the load planner on and off against recomputing, over hit sizes and three
pools, on CPU: the demo's tiny random Llama (8 layers, hidden 512, fp32), one standalone
local pool.

    python benchmarks/planner.py [--sizes 512 1024 2048] [--reps 5] [--rounds 2] [--slow-lease 0.5]
                                 [--slow-disk 0.25] [--json F]

Pools: ``fast``, the pool as it is; ``slow``, every load's lease takes ``--slow-lease``
seconds more (a throttled tier: tests/e2e/faulty_backend.py's latency fault); ``split``, a
pool with a disk tier where each hit's first half is in memory and the rest on a disk that
takes ``--slow-disk`` seconds per object (the ``disk_latency`` fault). For ``split`` one
engine saves every prompt, the pool stops (its memory goes to disk) and starts again, one
engine loads each size's first half (which brings it to memory), and the timed engine first
computes a prompt, loads it from memory and loads another from disk, so the planner has
measured every price; each timed prompt has its own second half, still on disk.

Modes: ``recompute`` (no connector), ``planner off``, ``planner on``. Each (pool, mode) is
one engine process (for ``split``, after the one that saves): it computes one prompt of each
size first (the pool fills; the planner learns what a token costs to compute), then sends
the same prompts ``--reps`` times, each request alone, one token each. Engine processes of
one configuration differ by up to 10% on a busy 2-core machine, so ``--rounds`` runs every
(pool, mode) that many times, round robin (every other round in reverse order), and pools
their repetitions. Prints the median TTFT per size and the planner's against the better of
the other two.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)
for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0",
             "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}.items():
    os.environ.setdefault(k, v)
MODES = {"recompute": None, "planner off": False, "planner on": True}


def engine(spec: dict) -> dict:
    """In a fresh process: fill, then time each hit; TTFT (ms) and tokens from the pool."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if spec["planner"] is not None:
        extra = {"backend": "tests.e2e.faulty_backend:FaultyBackend", "load_planner": spec["planner"],
                 "local": {"socket": spec["socket"], "start": "never"}}
        kv = KVTransferConfig(kv_connector="AscendStoreConnector", kv_role="kv_both",
                              kv_connector_module_path="ascend_store.connector",
                              kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    llm = LLM(model=spec["model"], dtype="float32", block_size=128, enable_prefix_caching=False,
              max_model_len=4096, distributed_executor_backend="uni", enforce_eager=True,
              kv_transfer_config=kv, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def prompts(name):
        return [TokensPrompt(prompt_token_ids=p) for p in spec.get(name, [])]

    if spec.get("fill"):  # fills the pool, and the planner's compute cost
        llm.generate(prompts("fill"), params, use_tqdm=False)
        time.sleep(1.0)  # the last saves drain
    for p in prompts("warm"):  # one at a time: each step measures one thing
        llm.generate([p], params, use_tqdm=False)
    time.sleep(0.5)
    rows = []
    for p in prompts("timed"):
        t = time.perf_counter()
        out = llm.generate([p], params, use_tqdm=False)[0]
        rows.append({"size": len(p["prompt_token_ids"]), "ttft_ms": (time.perf_counter() - t) * 1e3,
                     "loaded": out.num_cached_tokens or 0})
    planner = {}
    if kv is not None:  # what the planner decided and its prices, for the results file
        counters = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler.counters.total
        planner = {k: v for k, v in counters.items() if "planned" in k or k.startswith("planner_")}
    return {"rows": rows, "planner": planner}


def serve(socket: str, disk: str | None) -> subprocess.Popen:
    from ascend_store.backends.local.launcher import ping

    args = ["pool", "serve", "--socket", socket, "--capacity", "2GiB"]
    if disk:
        args += ["--disk-path", disk, "--disk-capacity", "8GiB"]
    pool = subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli", *args], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not ping(socket):
        if pool.poll() is not None or time.monotonic() > deadline:
            sys.exit("the pool did not start")
        time.sleep(0.1)
    return pool


def engine_process(spec: dict, fault: str, what: str) -> list:
    env = {**os.environ, "ASCEND_STORE_TEST_FAULT": fault, "PYTHONPATH": REPO}
    path = os.path.join(os.path.dirname(fault), "spec.json")  # too long for a command line
    with open(path, "w") as f:
        json.dump(spec, f)
    proc = subprocess.run([sys.executable, __file__, "--engine", path],
                          capture_output=True, text=True, env=env)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        sys.exit(f"{what} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(line[0][len("RESULT "):])
    if result["planner"]:
        print(f"  {what}: {json.dumps(result['planner'])}", flush=True)
    return result["rows"]


def split_prompts(rng, sizes: list[int], reps: int) -> dict:
    """Per size a head, a tail per repetition (and one to bring the head to memory)."""
    def tokens(n):
        return [rng.randrange(2, 500) for _ in range(n)]

    heads = {n: tokens(n // 2) for n in sizes}
    tails = {n: [tokens(n - n // 2) for _ in range(reps + 1)] for n in sizes}
    compute, disk = tokens(max(sizes)), tokens(max(sizes))
    return {"fill": [disk] + [heads[n] + t for n in sizes for t in tails[n]],
            "heads": [heads[n] + tails[n][0] for n in sizes],  # loaded whole: the heads go to memory
            "warm": [compute, compute, disk],  # compute, a memory hit, a disk hit: every price
            "timed": [heads[n] + tails[n][r] for r in range(1, reps + 1) for n in sizes]}


def run(args, model: str, workdir: str) -> dict:
    socket = os.path.join(workdir, "pool.sock")
    rng = random.Random(3)
    out: dict[str, list] = {}
    faults = {"fast": os.path.join(workdir, "no-fault.json")}
    for speed, kind, seconds in (("slow", "latency", args.slow_lease),
                                 ("split", "disk_latency", args.slow_disk)):
        faults[speed] = os.path.join(workdir, f"fault-{speed}.json")
        with open(faults[speed], "w") as f:
            json.dump({"role": "worker", "op": "lease", "kind": kind, "seconds": seconds}, f)
    # Odd rounds run the modes in reverse order: a drift of the machine's speed over a run
    # then weighs on every mode alike.
    order = lambda r: list(MODES.items())[::-1 if r % 2 else 1]  # noqa: E731
    for rnd, speed, (mode, planner) in [(r, s, m) for r in range(args.rounds) for s in args.pools
                                         for m in order(r)]:
        # A pool of its own per run, and fresh prompts: no run finds another's objects.
        disk = os.path.join(workdir, f"disk-{rnd}-{speed}-{planner}") if speed == "split" else None
        spec = {"model": model, "socket": socket, "planner": planner}
        if speed == "split":
            prompts = split_prompts(rng, args.sizes, args.reps)
        else:
            fill = [[rng.randrange(2, 500) for _ in range(n)] for n in args.sizes]
            prompts = {"fill": fill, "timed": fill * args.reps}
        print(f"round {rnd + 1}: {speed} pool, {mode} ...", flush=True)
        pool = serve(socket, disk)
        try:
            if speed == "split" and planner is not None:  # saved by one engine, then all on disk
                engine_process({**spec, "planner": False, "fill": prompts["fill"]}, faults["fast"], "fill")
                pool.terminate()  # a graceful stop writes the memory tier to disk
                pool.wait(60)
                pool = serve(socket, disk)
                engine_process({**spec, "planner": False, "warm": prompts["heads"]}, faults["fast"], "heads")
                prompts = {**prompts, "fill": []}
            rows = engine_process({**spec, **prompts}, faults[speed], f"{speed}/{mode}")
            out.setdefault(f"{speed}/{mode}", []).extend(rows)
        finally:
            pool.terminate()
            pool.wait(60)
    return out


def report(results: dict, sizes: list[int]) -> None:
    print("median TTFT ms (tokens from the pool)".ljust(34) + "".join(f"{n:>16}" for n in sizes))
    worst = 0.0
    for speed in dict.fromkeys(k.split("/")[0] for k in results):
        med = {}
        for mode in MODES:
            rows = results[f"{speed}/{mode}"]
            cells = []
            for n in sizes:
                mine = [r for r in rows if r["size"] == n]
                med[mode, n] = statistics.median(r["ttft_ms"] for r in mine)
                cells.append(f"{med[mode, n]:9.1f} ({statistics.median(r['loaded'] for r in mine):4.0f})")
            print(f"  {speed} pool, {mode}".ljust(34) + "".join(f"{c:>16}" for c in cells))
        ratios = [med["planner on", n] / min(med["planner off", n], med["recompute", n]) for n in sizes]
        worst = max(worst, *ratios)
        print(f"  {speed} pool, on / best of the others".ljust(34) + "".join(f"{r:16.2f}" for r in ratios))
    print(f"planner on, at worst {worst:.2f}x the better of loading and recomputing")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slow-lease", type=float, default=0.5)
    ap.add_argument("--slow-disk", type=float, default=0.25)
    ap.add_argument("--pools", nargs="+", default=["fast", "slow", "split"],
                    choices=["fast", "slow", "split"])
    ap.add_argument("--json")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        with open(args.engine) as f:
            print("RESULT " + json.dumps(engine(json.load(f))), flush=True)
        return
    from tests.e2e.models import build_llama

    model = build_llama("llama-demo", layers=8, hidden=512, heads=8, kv_heads=4)
    with tempfile.TemporaryDirectory(prefix="ascend-store-planner-") as workdir:
        results = run(args, model, workdir)
    report(results, args.sizes)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": args.sizes, "reps": args.reps, "rounds": args.rounds,
                       "slow_lease_s": args.slow_lease, "slow_disk_s": args.slow_disk, "runs": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
