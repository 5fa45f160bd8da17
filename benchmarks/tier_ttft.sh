#!/usr/bin/env bash
# TTFT of a miss, a memory hit and a disk hit, through the real OpenAI server and `ascend-store bench`.
#
# One standalone pool with a disk tier, one vLLM server (CPU, prefix caching off, so every reused
# token is the pool's). Run 1 of the long-doc-qa workload: its warm-up requests miss, its queries
# hit the memory tier. The pool is then restarted on the same disk directory (a graceful stop
# writes its memory tier to disk), so in run 2 (the same documents) the warm-up requests hit the
# disk tier (its files dropped from the page cache first), and its queries hit what those
# promoted back into memory.
#   bash benchmarks/tier_ttft.sh [OUT_DIR]     (about 3 minutes on 2 cores; run under the lock)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python}
OUT=${1:-$(mktemp -d /tmp/ascend-tier-ttft-XXXX)}
mkdir -p "$OUT"
export PYTHONPATH=$REPO HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0
MODEL=$($PY -c 'from tests.e2e.models import build_llama; print(build_llama("llama-demo", layers=8, hidden=512, heads=8, kv_heads=4))')
SOCK=$OUT/pool.sock PORT=${PORT:-8123}
pool() { $PY -m ascend_store.ops.cli pool serve --socket "$SOCK" --capacity 512MiB --disk-path "$OUT/disk" \
           --disk-capacity 4GiB 2>>"$OUT/pool.log" & echo $! > "$OUT/pool.pid"; }
stop_pool() { kill "$(cat "$OUT/pool.pid")"; while kill -0 "$(cat "$OUT/pool.pid")" 2>/dev/null; do sleep 0.1; done; }
wait_pool() { until $PY -m ascend_store.ops.cli pool status --socket "$SOCK" >/dev/null 2>&1; do sleep 0.2; done; }
pool; wait_pool
KV='{"kv_connector":"AscendStoreConnector","kv_connector_module_path":"ascend_store.connector","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"local":{"socket":"'$SOCK'","start":"never"}}}'
$PY -m vllm.entrypoints.openai.api_server --model "$MODEL" --host 127.0.0.1 --port "$PORT" --dtype float32 \
  --block-size 128 --no-enable-prefix-caching --max-model-len 4096 --enforce-eager \
  --kv-transfer-config "$KV" >"$OUT/server.log" 2>&1 & SERVER=$!
trap 'kill $SERVER 2>/dev/null; stop_pool 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 1; kill -0 $SERVER; done
BENCH=(--url "http://127.0.0.1:$PORT" --workload long-doc-qa --docs 6 --doc-tokens 2048 --repeat-count 1
       --output-tokens 1)
echo "== run 1: warm-up = miss, query = memory hit"
$PY -m ascend_store.ops.cli bench "${BENCH[@]}" --json "$OUT/run1.json"
$PY -m ascend_store.ops.cli pool status --socket "$SOCK" > "$OUT/status1.json"
stop_pool
# Cold disk hits: the files leave the page cache (fsync + POSIX_FADV_DONTNEED) before the restart.
$PY -c 'import os, sys
for n in os.listdir(sys.argv[1]):
    fd = os.open(os.path.join(sys.argv[1], n), os.O_RDONLY); os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)' "$OUT/disk"
pool; wait_pool
echo "== run 2 (pool restarted): warm-up = disk hit (cold files), query = memory hit"
$PY -m ascend_store.ops.cli bench "${BENCH[@]}" --json "$OUT/run2.json"
$PY -m ascend_store.ops.cli pool status --socket "$SOCK" | tee "$OUT/status2.json" | grep -E '"(promoted|spilled|objects)"'
