"""Scheduler half: prefix lookup in the pool, load/save planning, request lifecycle.

Per request we hash the prompt into chained chunk keys once, ask the pool which
leading chunks it holds for every layer and TP shard (one batched call), and plan:
- loads: the chunks past vLLM's own device-cache hit, in the step the request is
  scheduled;
- saves: each full prompt chunk in the step that finishes computing it, unless the
  pool already had it.
Saves complete inside the step (``wait_for_save``), so finished requests free their
blocks at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ascend_store.backends import BackendUnavailable, create_backend
from ascend_store.config import StoreConfig
from ascend_store.hit_cache import BlockHitCache
from ascend_store.keys import KeySpace, chunk_hashes, identity_from_vllm
from ascend_store.layers import layer_ids
from ascend_store.metadata import ChunkLoad, ChunkSave, StepMetadata, WorkerReport
from ascend_store.stats import AscendStoreStats, IntervalCounters

log = logging.getLogger("ascend_store")


def is_compacted(request) -> bool:
    """The compaction contract (docs/codecs.md): a token-eviction method that drops KV of
    a request marks it with ``kv_compacted: True`` in the request's ``kv_transfer_params``
    or in its sampling params' ``extra_args``. Such KV no longer matches its token prefix,
    so it is never published under prefix keys."""
    for params in (getattr(request, "kv_transfer_params", None),
                   getattr(getattr(request, "sampling_params", None), "extra_args", None)):
        if isinstance(params, dict) and params.get("kv_compacted"):
            return True
    return False


@dataclass
class _Request:
    request: object  # vLLM's Request, for flags that may change while it runs
    hashes: list[str]
    block_ids: list[int] = field(default_factory=list)
    saved_chunks: int = 0  # chunks [0, saved_chunks) need no save from this request
    local_tokens: int = 0  # vLLM's own device-cache hit at the last lookup
    pending_load: list[ChunkLoad] = field(default_factory=list)


class PoolScheduler:
    def __init__(self, vllm_config, kv_cache_config, cfg: StoreConfig, kv_role: str):
        self.cfg = cfg
        self.block_size = vllm_config.cache_config.block_size
        self.chunk = cfg.chunk_tokens(self.block_size)
        self.blocks_per_chunk = self.chunk // self.block_size
        self.can_load = kv_role in ("kv_both", "kv_consumer")
        self.can_save = kv_role in ("kv_both", "kv_producer")
        identity = identity_from_vllm(vllm_config, self.chunk, cfg.codec)
        tp = identity.tp_size
        self.keyspaces = [KeySpace(identity.namespace(), r, tp) for r in range(tp)]
        self.layers = sorted(set(layer_ids(kv_cache_config).values()))
        self.backend = create_backend(cfg, role="scheduler") if self.can_load else None
        lc = cfg.lookup_cache
        self.hit_cache = BlockHitCache(lc.ttl_s, lc.max_entries) if lc.enabled and self.can_load else None
        self._reqs: dict[str, _Request] = {}
        self.counters = IntervalCounters()

    # -- lookup ---------------------------------------------------------------
    def _pool_hit_chunks(self, hashes: list[str], start: int) -> int:
        """Number of leading chunks (from 0) the pool holds, checking from ``start``.

        Cached answers are used first: a cached miss ends the prefix with no call at all;
        the uncached rest goes to the pool in one batch and every answer is cached."""
        self.counters["lookups"] += 1
        cache = self.hit_cache
        i = start
        if cache is not None:
            cache.observe(self.backend.generation())
            while i < len(hashes) and (hit := cache.get(hashes[i])) is not None:
                if not hit:
                    return i
                i += 1
        if i >= len(hashes):
            return i
        keys = [ks.key(g, layer, h) for h in hashes[i:] for ks in self.keyspaces
                for g, layer in self.layers]
        self.counters["lookup_rpcs"] += 1
        try:
            found = self.backend.exists(keys)
        except BackendUnavailable:
            self.counters["lookup_errors"] += 1
            return i
        per_chunk = len(self.keyspaces) * len(self.layers)
        hits = [all(found[j * per_chunk:(j + 1) * per_chunk]) for j in range(len(hashes) - i)]
        if cache is not None:
            cache.observe(self.backend.generation())
            for h, hit in zip(hashes[i:], hits):
                cache.put(h, hit)
        return i + (hits.index(False) if False in hits else len(hits))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        prompt = request.prompt_token_ids or []
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _Request(request, chunk_hashes(prompt, self.chunk))
        state.local_tokens = num_computed_tokens
        start = num_computed_tokens // self.chunk
        state.saved_chunks = max(state.saved_chunks, start)
        state.pending_load = []
        if not self.can_load:
            return 0, False
        t0 = time.perf_counter()
        hit = self._pool_hit_chunks(state.hashes, start)
        self.counters["lookup_seconds"] += time.perf_counter() - t0
        state.saved_chunks = max(state.saved_chunks, hit)
        # vLLM must compute at least the last prompt token itself.
        hit_tokens = min(hit * self.chunk, len(prompt) - 1)
        self.counters["queried_tokens"] += len(prompt)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        self.counters["hit_tokens"] += hit_tokens - num_computed_tokens
        return hit_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return
        block_ids = blocks.get_block_ids()[0]
        local = state.local_tokens
        end = local + num_external_tokens
        first_block = local // self.block_size
        bpc = self.blocks_per_chunk
        for c in range(local // self.chunk, -(-end // self.chunk)):
            lo = max(c * bpc, first_block)
            state.pending_load.append(ChunkLoad(request.request_id, 0, state.hashes[c],
                                                block_ids[lo:(c + 1) * bpc], skip=lo - c * bpc))

    # -- per step -------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> StepMetadata:
        meta = StepMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            meta.loads.extend(state.pending_load)
            state.pending_load = []
            self._plan_saves(new.req_id, state, new.num_computed_tokens
                             + scheduler_output.num_scheduled_tokens[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_blocks[0]) if new_blocks else []
                meta.loads.extend(state.pending_load)
                state.pending_load = []
            elif new_blocks:
                state.block_ids.extend(new_blocks[0])
            self._plan_saves(req_id, state, cached.num_computed_tokens[i]
                             + scheduler_output.num_scheduled_tokens[req_id], meta)
        return meta

    def _plan_saves(self, req_id: str, state: _Request, computed_after_step: int,
                    meta: StepMetadata) -> None:
        if not self.can_save:
            return
        if is_compacted(state.request):
            self.counters["compacted_skips"] += 1
            return
        done = min(len(state.hashes), computed_after_step // self.chunk)
        bpc = self.blocks_per_chunk
        for c in range(state.saved_chunks, done):
            meta.saves.append(ChunkSave(req_id, 0, state.hashes[c],
                                        state.block_ids[c * bpc:(c + 1) * bpc]))
        if self.hit_cache is not None:  # a cached miss must not hide what we now save
            self.hit_cache.invalidate(state.hashes[state.saved_chunks:done])
        state.saved_chunks = max(state.saved_chunks, done)

    def update_connector_output(self, connector_output) -> None:
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(report, WorkerReport) and self.hit_cache is not None:
            self.hit_cache.invalidate(report.failed_chunks)

    def request_finished(self, request) -> tuple[bool, None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    def stats(self) -> AscendStoreStats:
        if self.hit_cache is not None:
            for k, v in self.hit_cache.counters.items():
                self.counters[k] = v
        return AscendStoreStats(self.counters.take())

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.close()
