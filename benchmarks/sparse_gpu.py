"""A small DeepSeek-V3.2 (sparse MLA with the lightning indexer, random weights) on one
CUDA GPU with the connector: a fresh engine's full pool hit, every KV cache tensor of it
(the MLA latent and the indexer's keys) overwritten first, must give the first token of the
engine that computed the prompt, for each KV cache format asked (bf16: ``auto``; ``fp8``:
vLLM's ``fp8_ds_mla``).

    python benchmarks/sparse_gpu.py [--tokens 2048] [--kv-cache-dtypes auto fp8]

One standalone local pool; per format two engine processes one after the other (the first
computes and saves, the second loads). Prints one line per format and exits 1 on an error
or a first token other than the computing engine's.

vLLM's sparse indexer needs DeepGEMM on CUDA (``sparse_attn_indexer.py`` refuses to build
the layer without it), and the offline GPU kit (../shared/gpu-kit) strips the copy vLLM's
wheel vendors (``vllm/third_party/deep_gemm``): unpack that folder from the same wheel over
the kit first. DeepGEMM compiles its kernels at run time, with NVCC or NVRTC under
``CUDA_HOME``. Without it this script stops before starting anything and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIG = {  # DeepSeek-V3.2's attention at its real head sizes; two dense layers, a small MLP
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 1024,
    "intermediate_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": 768, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
    "v_head_dim": 128, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
    "first_k_dense_replace": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "vocab_size": 32000,
    "max_position_embeddings": 16384, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}


def scrub_all_kv_caches(worker) -> int:
    """In each worker: overwrite every KV cache tensor, 1-byte formats included (fp8_ds_mla
    and the indexer's fp8 keys with their scales), so only what a load writes is read."""
    import torch

    n = 0
    for layer in worker.vllm_config.compilation_config.static_forward_context.values():
        cache = getattr(layer, "kv_cache", None)
        for t in cache if isinstance(cache, (list, tuple)) else [cache]:
            if isinstance(t, torch.Tensor) and t.numel():
                t.view(torch.uint8).fill_(0x3C)
                n += 1
    torch.cuda.synchronize()
    return n


def child(spec: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = {"kv_connector": "AscendStoreConnector", "kv_connector_module_path": "ascend_store.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"local": {"socket": spec["socket"], "start": "never"}}}
    llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              max_model_len=spec["tokens"] + 64, enforce_eager=True, enable_prefix_caching=False,
              gpu_memory_utilization=0.5, block_size=64, kv_cache_dtype=spec["kv_cache_dtype"],
              kv_transfer_config=KVTransferConfig(**kv))
    rng = random.Random(spec["tokens"])
    prompt = TokensPrompt(prompt_token_ids=[rng.randrange(3, 32000) for _ in range(spec["tokens"])])
    params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    if spec["role"] == "hit":
        scrubbed = sum(llm.collective_rpc(scrub_all_kv_caches))
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    if spec["role"] == "fill":
        time.sleep(2.0)  # the save drains before the engine goes
    print("RESULT " + json.dumps({"token": out.outputs[0].token_ids[0], "cached": out.num_cached_tokens or 0,
                                  "scrubbed": scrubbed if spec["role"] == "hit" else None}), flush=True)


def run_child(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": REPO + os.pathsep
                                                       + os.environ.get("PYTHONPATH", "")})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": proc.stderr[-3000:]}
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"])
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    import torch
    from vllm.utils.import_utils import has_deep_gemm

    if torch.cuda.is_available() and not has_deep_gemm():
        print("this vLLM has no DeepGEMM, which its DeepSeek-V3.2 indexer needs on CUDA: unpack "
              "vllm/third_party/deep_gemm from the vLLM wheel over it (see this script's docstring)")
        return 2
    tmp = tempfile.mkdtemp(prefix="ascend-sparse-")
    model = os.path.join(tmp, "model")
    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    socket = os.path.join(tmp, "pool", "pool.sock")
    serve = ["pool", "serve", "--socket", socket, "--capacity", "8GiB"]
    pool = subprocess.Popen([sys.executable, "-m", "ascend_store.ops.cli", *serve],
                            env={**os.environ, "PYTHONPATH": REPO})
    ok = True
    try:
        for dtype in args.kv_cache_dtypes:
            spec = {"model": model, "socket": socket, "tokens": args.tokens, "kv_cache_dtype": dtype}
            fill = run_child({**spec, "role": "fill"})
            hit = run_child({**spec, "role": "hit"}) if "error" not in fill else {"error": "no fill"}
            same = "error" not in hit and hit["token"] == fill["token"] and hit["cached"] > 0
            ok &= same
            print(f"kv_cache_dtype {dtype}: computed {fill.get('token')}; fresh engine, "
                  f"{hit.get('scrubbed')} caches scrubbed, hit {hit.get('cached')} tokens, first token "
                  f"{hit.get('token')}: {'same' if same else 'DIFFERENT'}", flush=True)
            for r in (fill, hit):
                if "error" in r:
                    print(r["error"], flush=True)
    finally:
        pool.terminate()
        pool.wait(10)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
