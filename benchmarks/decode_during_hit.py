"""Requests decoding while a long pool hit loads: in the step (layerwise) or off it.

One engine per configuration (e2e_gpu.py's geometries, vLLM's dummy weights, its CUDA graphs
with ``--graphs``). A ``--tokens`` prompt is computed once, so the pool holds it. Then, per
repetition: vLLM's prefix cache is reset (and with ``--scrub`` the KV cache overwritten),
``--decoders`` requests with 512-token prompts start decoding, after ``--warm`` steps the long
prompt arrives again (a full pool hit, one output token), and decoding goes on for ``--after``
steps past its token. Measured on the engine's own steps (``LLMEngine.step``):
  before   the decoders' time per output token over the ``--warm`` steps before the hit arrives
  during   the mean interval between a decoder's tokens from the hit's arrival to its token
  ttft     the hit's arrival to its token; its token must be the one the engine computed first
Printed per configuration: medians over ``--reps``, during / before, and each configuration's
TTFT over the first configuration's (the in-step load, by default).

    python benchmarks/decode_during_hit.py --geometry 7b --tokens 32768 --decoders 15 --graphs \\
        --scrub --json decode_during_hit.json
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import e2e_gpu  # noqa: E402


def child(spec: dict) -> None:
    """One engine: every repetition's numbers in a RESULT line."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, conf = e2e_gpu.make_engine(spec)
    engine = llm.llm_engine
    n = spec["tokens"][0]
    rng = random.Random(n)
    long = TokensPrompt(prompt_token_ids=[rng.randrange(3, 32000) for _ in range(n)])
    one = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    computed = llm.generate([long], one, use_tqdm=False)[0].outputs[0].token_ids[0]
    time.sleep(1.0)  # its saves drain
    steps = spec["warm"] + spec["after"] + 64
    many = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, detokenize=False)
    reps = []
    for rep in range(spec["reps"] + 1):  # the first is a warm-up
        e2e_gpu.reset(llm, spec, conf)
        decoders = [f"d{rep}-{i}" for i in range(spec["decoders"])]
        for rid in decoders:
            prompt = [rng.randrange(3, 32000) for _ in range(512)]
            engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), many)
        arrivals: list[float] = []  # decoder 0's token times
        seen, hit, t_arrive, t_hit, token, cached = 0, f"hit{rep}", None, None, None, None
        after = 0
        while after < spec["after"] and engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id == decoders[0] and len(o.outputs[0].token_ids) > seen:
                    seen = len(o.outputs[0].token_ids)
                    arrivals.append(now)
                elif o.request_id == hit and o.outputs and o.outputs[0].token_ids and t_hit is None:
                    t_hit, token, cached = now, o.outputs[0].token_ids[0], o.num_cached_tokens or 0
            if t_arrive is None and len(arrivals) > spec["warm"]:
                engine.add_request(hit, long, one)
                t_arrive = time.perf_counter()
            elif t_hit is not None:
                after += 1
        for rid in decoders:
            engine.abort_request([rid])
        while engine.has_unfinished_requests():
            engine.step()
        if rep == 0:
            continue
        if t_hit is None:
            raise RuntimeError("the hit produced no token")
        before = [b - a for a, b in zip(arrivals, arrivals[1:]) if b <= t_arrive][-spec["warm"]:]
        during = [b - a for a, b in zip(arrivals, arrivals[1:]) if t_arrive < b <= t_hit]
        reps.append({"before_ms": 1e3 * statistics.median(before),
                     "during_ms": 1e3 * statistics.mean(during) if during else float("nan"),
                     "during_max_ms": 1e3 * max(during, default=float("nan")), "tokens_during": len(during),
                     "ttft_ms": 1e3 * (t_hit - t_arrive), "token": token, "cached": cached})
    print("RESULT " + json.dumps({"computed": computed, "reps": reps}), flush=True)


def summary(got: dict) -> dict:
    med = lambda k: statistics.median(r[k] for r in got["reps"])  # noqa: E731
    return {"before_ms": med("before_ms"), "during_ms": med("during_ms"), "ttft_ms": med("ttft_ms"),
            "during_over_before": med("during_ms") / med("before_ms"),
            "same_token": all(r["token"] == got["computed"] for r in got["reps"]),
            "cached": [r["cached"] for r in got["reps"]], "n": len(got["reps"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="7b", choices=list(e2e_gpu.GEOMETRIES))
    ap.add_argument("--configs", nargs="+", default=["ascend-layerwise-raw", "ascend-layerwise-raw-async"],
                    choices=list(e2e_gpu.CONFIGS))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--decoders", type=int, default=15)
    ap.add_argument("--warm", type=int, default=20, help="decode steps before the hit arrives")
    ap.add_argument("--after", type=int, default=10, help="decode steps after the hit's token")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (after one warm-up)")
    ap.add_argument("--graphs", action="store_true", help="vLLM's CUDA graphs (its default) instead of eager")
    ap.add_argument("--scrub", action="store_true", help="overwrite the KV cache before each hit")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--json")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    gbs = e2e_gpu.link_gbs()
    gpu = gbs == gbs  # NaN without CUDA: the CPU smoke run
    results = {}
    for name in args.configs:
        spec = {"config": name, "model": e2e_gpu.model_dir(args.geometry), "tokens": [args.tokens],
                "reps": args.reps, "tmp": tempfile.mkdtemp(prefix="ascend-ddh-"), "gpu": gpu,
                "decoders": args.decoders, "warm": args.warm, "after": args.after, "graphs": args.graphs,
                "scrub": args.scrub, "name": f"{args.geometry}-{name}",
                "concurrent_tokens": 512 + args.warm + args.after + 128}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([e2e_gpu.REPO, os.environ.get("PYTHONPATH", "")])}
        if args.scrub:
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=args.timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        got = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-3000:]}
        results[name] = got
        if "error" in got:
            print(f"{name}: FAILED {got['error'][-1500:]}", flush=True)
            continue
        got["summary"] = s = summary(got)
        print(f"{name:28s} decode {s['before_ms']:.2f} ms/token before, {s['during_ms']:.2f} during the hit "
              f"({s['during_over_before']:.2f}x); hit TTFT {s['ttft_ms']:.1f} ms (hit {s['cached']}, "
              f"{'same' if s['same_token'] else 'OTHER'} first token), n = {s['n']}", flush=True)
    done = [n for n in args.configs if "summary" in results[n]]
    if len(done) > 1:
        base = results[done[0]]["summary"]["ttft_ms"]
        for n in done[1:]:
            print(f"TTFT {n} / {done[0]}: {results[n]['summary']['ttft_ms'] / base:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"geometry": args.geometry, "tokens": args.tokens, "decoders": args.decoders,
                       "runs": results}, f, indent=1)
    if any("error" in r or not r["summary"]["same_token"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
