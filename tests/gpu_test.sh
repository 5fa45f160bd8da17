#!/usr/bin/env bash
# `make gpu-test`: on a CUDA machine, every CUDA-only unit test (the batched device path, the
# compiled Triton copy and int8 kernels bit for bit, the layout self-test with pinned pool
# memory) and one real-engine check (a 4K-token full hit of
# the 1B geometry under vLLM's CUDA graphs, the KV cache scrubbed first, must give
# recompute's first token, raw and int8), and the same for a tiny hybrid (Qwen3-Next: GDN
# state pooled, its copies deferred behind each layer's load), which must also decode
# recompute's 16 greedy tokens. Needs torch with CUDA, vLLM, pytest, pyzmq and
# msgpack in GPU_PYTHON; no network. Writes its output to $1 as well.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
OUT=${1:-benchmarks/results/gpu_test.txt}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import sys, torch, vllm; print('python', sys.version.split()[0], 'torch', torch.__version__,
            'vllm', vllm.__version__, 'cuda', torch.cuda.is_available())"
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/test_int8_kernel.py tests/unit/test_device_path.py \
    tests/unit/test_selftest.py
  "$PY" benchmarks/e2e_gpu.py --geometry 1b --tokens 4096 --reps 3 --graphs --scrub --check \
    --configs recompute ascend-layerwise-raw ascend-layerwise-int8
  "$PY" benchmarks/e2e_gpu.py --geometry hybrid-tiny --tokens 4096 --reps 1 --graphs --scrub --check \
    --greedy 16 --spread-weights --configs recompute ascend-layerwise-raw
} 2>&1 | tee "$OUT"
