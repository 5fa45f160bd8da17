"""The README's demo: real vLLM (CPU) with AscendStoreConnector on a standalone local pool.

The demo starts one standalone pool (``ascend-store pool serve``, as in production; an
engine's embedded pool would stop with that engine). Engine A serves a shared-prefix
workload (4 documents x 3 questions) into the empty pool; engine B, a fresh process,
serves it again from the same pool. When anything fails the pool's log is shown too.
vLLM's own prefix cache is off, so every reused token comes from the pool.
Each request runs alone with max_tokens=1, so its wall time is its TTFT. It first prints
the CPU's vector ISA, which picks vLLM CPU's kernels. The pool's socket, log and arena are
gone when it exits, whether it passed or failed.

    python benchmarks/demo.py [--docs 4] [--questions 3] [--doc-tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)
from ascend_store.ops.bench.workloads import Shape, shared_prefix  # noqa: E402

for k, v in {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0",
             "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}.items():
    os.environ.setdefault(k, v)


def cpu_isa(flags: set[str]) -> str:
    """The x86 vector ISA vLLM CPU's kernels run with, from /proc/cpuinfo's flags."""
    if "avx512f" in flags:
        return "AVX-512 with AMX" if "amx_tile" in flags else "AVX-512"
    return "AVX2" if "avx2" in flags else "no AVX2 (vLLM CPU needs AVX2 on x86)"


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(ln.split(":", 1)[1].split()) for ln in f if ln.startswith("flags")), set())
    except OSError:
        return set()


# The README's numbers come from an AVX-512 VM. On that VM (2 cores, shared), 2026-12-06,
# this demo gave 592.7 ms recomputed and 52.5 ms with a pool hit, and with vLLM's and
# torch's AVX2 kernels forced (torch.cpu._is_avx512_supported() answering False,
# ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2) 695.3 and 77.8 ms.
AVX2_NOTE = ("vLLM CPU runs its AVX2 kernels here; the README's numbers come from an AVX-512 CPU. "
             "With the AVX2 kernels forced on that CPU a recompute took 1.2x and a pool hit 1.5x "
             "as long (a hit still about 9x faster than a recompute); an older AVX2-only CPU is "
             "slower still")


def serve(model: str, socket: str, prompts: list[list[int]]) -> list[dict]:
    """Run inside a fresh process: one engine, each request alone, wall time per request."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = KVTransferConfig(kv_connector="AscendStoreConnector",
                          kv_connector_module_path="ascend_store.connector",
                          kv_role="kv_both", kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"backend": "local", "use_layerwise": True,
                                                     "local": {"socket": socket, "start": "never"}})
    llm = LLM(model=model, dtype="float32", block_size=128, enable_prefix_caching=False,
              max_model_len=4096, distributed_executor_backend="uni", enforce_eager=True,
              kv_transfer_config=kv, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 8)], params, use_tqdm=False)  # warm-up
    rows = []
    for p in prompts:
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
        rows.append({"ttft_ms": (time.perf_counter() - t) * 1e3, "prompt": len(p),
                     "loaded": out.num_cached_tokens or 0})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description="TTFT with and without pool hits, two engines, one pool.",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--docs", type=int, default=4, help="documents")
    ap.add_argument("--questions", type=int, default=3, help="questions per document")
    ap.add_argument("--doc-tokens", type=int, default=1024, help="tokens per document")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = Shape(docs=args.docs, questions=args.questions, doc_tokens=args.doc_tokens, question_tokens=48)
    prompts = [r.prompt for r in shared_prefix(shape).requests()]
    if args.phase:
        model, socket = args.phase.split(",")
        print("ROWS " + json.dumps(serve(model, socket, prompts)), flush=True)
        return

    from tests.e2e.models import build_llama

    isa = cpu_isa(cpu_flags())
    print(f"CPU: {isa}" + (f". {AVX2_NOTE}" if isa == "AVX2" else ""), flush=True)
    model = build_llama("llama-demo", layers=8, hidden=512, heads=8, kv_heads=4)
    with tempfile.TemporaryDirectory(prefix="ascend-store-demo-") as workdir:
        phases = run_phases(args, model, workdir)
    report(phases)


def run_phases(args, model: str, workdir: str) -> dict[str, list[dict]]:
    """Engine A then engine B on one standalone pool in ``workdir``; the pool is stopped
    (it removes its arena) before ``workdir`` goes."""
    from ascend_store.backends.local.launcher import ping

    socket, pool_log = os.path.join(workdir, "pool.sock"), os.path.join(workdir, "pool.log")
    print(f"starting a standalone pool at {socket} ...", flush=True)
    with open(pool_log, "wb") as log_file:
        pool = subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli", "pool", "serve", "--socket",
                                 socket, "--capacity", "2GiB"], stderr=log_file)

    def fail(what: str) -> None:
        with open(pool_log) as f:
            sys.exit(f"{what}\n--- pool log ---\n{f.read()[-4000:]}")

    try:
        deadline = time.monotonic() + 30
        while not ping(socket):
            if pool.poll() is not None or time.monotonic() > deadline:
                fail("the pool did not start")
            time.sleep(0.1)
        phases = {}
        for name in ("engine A (empty pool)", "engine B (fresh process)"):
            print(f"running {name} ...", flush=True)
            proc = subprocess.run([sys.executable, __file__, "--docs", str(args.docs), "--questions",
                                   str(args.questions), "--doc-tokens", str(args.doc_tokens),
                                   "--phase", f"{model},{socket}"], capture_output=True, text=True)
            line = [x for x in proc.stdout.splitlines() if x.startswith("ROWS ")]
            if proc.returncode or not line:
                fail(f"{name} failed:\n{proc.stderr[-4000:]}")
            phases[name] = json.loads(line[0][5:])
    finally:
        pool.terminate()
        try:
            pool.wait(30)
        except subprocess.TimeoutExpired:
            pool.kill()
            pool.wait()
    return phases


def report(phases: dict[str, list[dict]]) -> None:
    print()
    print(f"{'phase':<26}{'requests':>9}{'prompt tok':>11}{'from pool':>10}"
          f"{'TTFT miss ms':>13}{'TTFT hit ms':>12}")
    all_rows = [r for rows in phases.values() for r in rows]
    for name, rows in phases.items():
        miss = [r["ttft_ms"] for r in rows if r["loaded"] == 0]
        hit = [r["ttft_ms"] for r in rows if r["loaded"] > 0]
        fmt = lambda xs: f"{statistics.median(xs):.1f}" if xs else "-"  # noqa: E731
        print(f"{name:<26}{len(rows):>9}{sum(r['prompt'] for r in rows):>11}"
              f"{sum(r['loaded'] for r in rows):>10}{fmt(miss):>13}{fmt(hit):>12}")
    miss = [r["ttft_ms"] for r in all_rows if r["loaded"] == 0]
    hit = [r["ttft_ms"] for r in all_rows if r["loaded"] > 0]
    if miss and hit:
        print(f"\nmedian TTFT: {statistics.median(miss):.1f} ms recomputed, {statistics.median(hit):.1f} ms "
              f"with a pool hit ({statistics.median(miss) / statistics.median(hit):.1f}x), "
              "vLLM prefix caching off, layerwise on, CPU.")


if __name__ == "__main__":
    main()
