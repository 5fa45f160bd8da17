"""Scheduler half: prefix lookup in the pool, load/save planning, request lifecycle.

Per request we hash the prompt into chained chunk keys once, ask the pool which
leading chunks it holds (one key per chunk, KV cache group and TP shard: a chunk object
holds every layer; asked off the engine's thread, one call per step: lookups.py), and plan:
- loads: the chunks past vLLM's own device-cache hit, in the step the request is
  scheduled;
- saves: each full prompt chunk in the step that finishes computing it, unless the
  pool already had it, and, once the prompt is computed, its *tail*: the whole blocks
  past its last full chunk, as one shorter object, so a repeated prompt recomputes at
  most one block (dense models; a hybrid hit must end where the state was saved).
Hybrid models (docs/hybrid.md): a hit also needs every linear-attention layer's state
at the hit's last chunk boundary; that state is saved when a step ends on a chunk
boundary (vLLM's align mode keeps the state only there) and loaded into the block vLLM
reads the state of a hit from.
A step's saves are waited for at the start of the next step (``defer_save_drain``), before
vLLM can reuse a finished request's blocks.
A compacted request publishes nothing (compaction.py); with ``save_decode_cache`` the
chain goes on over the generated tokens (decode_saves.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from ascend_store.backends import create_backend
from ascend_store.common import seams
from ascend_store.common.config import StoreConfig
from ascend_store.common.keys import (
    KeyExtras,
    KeySpace,
    chunk_hashes,
    identity_from_vllm,
    partial_hashes,
    request_extras,
)
from ascend_store.common.layers import ATTN, STATE, group_kinds
from ascend_store.common.metadata import ChunkLoad, ChunkSave, StepMetadata, WorkerReport
from ascend_store.common.parallel import sharding
from ascend_store.ops.stats import AscendStoreStats, IntervalCounters
from ascend_store.scheduler import kv_events
from ascend_store.scheduler.compaction import CompactionPlans, is_compacted
from ascend_store.scheduler.decode_saves import DecodeChain
from ascend_store.scheduler.graph_steps import FullGraphSteps
from ascend_store.scheduler.hit_cache import BlockHitCache
from ascend_store.scheduler.lookups import STATE_TAG, TAIL_TAG, LookupState, PoolLookups
from ascend_store.scheduler.marks import LOSSLESS, marked
from ascend_store.scheduler.pd_wait import ProducerWait
from ascend_store.scheduler.planner import LoadPlanner

log = logging.getLogger("ascend_store")


@dataclass
class _Request:
    request: object  # vLLM's Request, for flags that may change while it runs
    hashes: list[str]
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    saved_chunks: int = 0  # chunks [0, saved_chunks) need no save from this request
    pool_hit: int = 0  # chunks the pool served at the last lookup (hybrid: state at its end)
    local_tokens: int = 0  # vLLM's own device-cache hit at the last lookup
    pending_load: list[ChunkLoad] = field(default_factory=list)
    tail_hit: tuple[str, int] | None = None  # (partial hash, blocks) the pool served past pool_hit
    tail_saved: bool = False
    prompt_done: bool = False  # its prompt is computed (a producer's reply may leave)
    load_async: bool = False  # its hit loads off the step (async_loads.py)
    async_blocks: set[int] = field(default_factory=set)  # blocks its async load fills
    load_failed: bool = False  # its async load failed: recompute, do not ask the pool again
    extras: KeyExtras | None = None  # what names the request's KV besides its tokens
    compacted: bool = False  # the TriAttention plugin planned to compact its KV
    lookup: LookupState = field(default_factory=LookupState)  # its pool lookup, across steps
    load_tiers: np.ndarray | None = None  # tokens its planned load takes from each tier (load planner)


class PoolScheduler:
    def __init__(self, vllm_config, kv_cache_config, cfg: StoreConfig, kv_role: str):
        self.cfg = cfg
        self.block_size = vllm_config.cache_config.block_size
        self.chunk = cfg.chunk_tokens(self.block_size)
        self.blocks_per_chunk = self.chunk // self.block_size
        self.can_load = kv_role in ("kv_both", "kv_consumer")
        self.can_save = kv_role in ("kv_both", "kv_producer")
        self.kinds = group_kinds(kv_cache_config)
        shards = sharding(vllm_config, cfg.head_slices, STATE in self.kinds, cfg.layer_slices,
                          len(self.kinds) == 1)
        ns = identity_from_vllm(vllm_config, self.chunk, cfg.codec, shards).namespace()
        # A hit needs the chunk's object of every group in every shard of every layer span
        # (parallel.py: a shard per TP rank, one for MLA, or head slices; a span per
        # pipeline stage, or fixed layer spans).
        self.keyspaces = [KeySpace(ns, shard, span) for span in shards.all_spans()
                          for shard in shards.all_shards()]
        self.attn_groups = [g for g, kind in enumerate(self.kinds) if kind == ATTN]
        self.state_groups = [g for g, kind in enumerate(self.kinds) if kind == STATE]
        if len(self.kinds) > 1:  # vLLM cannot map block-level load failures itself
            seams.install_failed_load_preemption()
        # A producer's scheduler asks the pool only to report its objects as KV events.
        self.backend = create_backend(cfg, role="scheduler") \
            if self.can_load or kv_events.enabled(vllm_config) else None
        lc = cfg.lookup_cache
        self.hit_cache = BlockHitCache(lc.ttl_s, lc.max_entries) if lc.enabled and self.can_load else None
        self._reqs: dict[str, _Request] = {}
        self.compaction = CompactionPlans()  # compacted KV is never published (compaction.py)
        # Whole mode loads off the step (async_loads.py), layerwise mode hits of at least
        # async_load_min_tokens; block-level failures need one KV cache group (vLLM cannot
        # map them otherwise), so hybrid models load in the step.
        self.async_load = cfg.async_load and self.kinds == [ATTN] and \
            (not cfg.use_layerwise or cfg.async_load_min_tokens > 0)
        self.async_min_tokens = cfg.async_load_min_tokens if cfg.use_layerwise else 0
        self._async_ready: list[str] = []  # allocated, load not yet sent to the workers
        self.commit_before_reply = cfg.commit_before_reply and kv_role == "kv_producer"
        self.counters = IntervalCounters()
        self.full_graph = FullGraphSteps(vllm_config)  # steps vLLM may replay whole (graph_steps.py)
        self.decode_chain = DecodeChain(self.chunk, self.counters) \
            if cfg.save_decode_cache and self.can_save and not self.state_groups else None
        self.producer_wait = ProducerWait(cfg.consumer_wait_s, self.counters)  # pd_wait.py
        # Saved objects as vLLM KV events (kv_events.py): one pool call per step, when on.
        self.kv_events = kv_events.KVEventFeed(self.backend, self.keyspaces, self.attn_groups,
                                               self.block_size, kv_cache_config) \
            if self.backend is not None and kv_events.enabled(vllm_config) else None
        # Lookups answered off the engine's thread, one pool call per step (lookups.py).
        # Load or recompute each hit, from the engine's own timings of each step (planner.py).
        self.planner = LoadPlanner(self.counters) if cfg.load_planner and self.can_load else None
        self._step = 0
        self.lookups = PoolLookups(self.backend, self.keyspaces, self.attn_groups, self.state_groups,
                                   self.hit_cache, self.counters, cfg.lookup_timeout_s, self.kv_events,
                                   first_deadline_s=cfg.timeout_s) \
            if self.backend is not None else None

    # -- lookup ---------------------------------------------------------------
    def _tails(self, state: _Request, c: int) -> list[str]:
        """Hashes of chunk ``c`` cut after 1, 2, ... whole blocks of the prompt. None for
        prompt embeddings (they name only whole chunks)."""
        if getattr(state.request, "prompt_embeds", None) is not None:
            return []
        return partial_hashes(state.request.prompt_token_ids or [], self.chunk, self.block_size,
                              state.hashes[c - 1] if c else None, c * self.chunk, state.extras)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.producer_wait.too_soon(request.request_id):
            return None, False  # vLLM skips the request this step and asks again
        prompt = request.prompt_token_ids or []
        state = self._reqs.get(request.request_id)
        if state is None:
            hashes, extras = self.request_chain(request)
            state = self._reqs[request.request_id] = _Request(request, hashes, extras=extras)
        state.local_tokens = num_computed_tokens
        start = num_computed_tokens // self.chunk
        # Asked again after a preemption: what the pool holds now decides what to save
        # (a failed load removed its objects, so the recompute republishes them).
        state.saved_chunks = start
        state.pending_load = []
        state.load_async = False
        if not self.can_load:
            return 0, False
        if state.load_failed:  # vLLM freed what the failed load held and asks again
            state.load_failed = False
            return 0, False
        # vLLM computes at least the last prompt token itself; a hybrid hit must also end
        # on a chunk boundary, where the pool holds the state.
        limit = (len(prompt) - 1) // self.chunk if self.state_groups else len(state.hashes)
        found = self.lookups.lookup(state.lookup, state.hashes, start, limit, lambda c: self._tails(state, c))
        if found is None:
            return None, False  # asked on the lookup thread: vLLM asks again next step
        hit = found.chunks
        state.saved_chunks = max(start, hit)
        state.pool_hit = hit
        hit_tokens = hit * self.chunk
        state.tail_hit = found.tail
        if state.tail_hit is not None:
            hit_tokens += state.tail_hit[1] * self.block_size
        state.tail_saved = state.tail_hit is not None
        hit_tokens = min(hit_tokens, len(prompt) - 1)
        # A producer stores the prompt's whole blocks (hybrid: its whole chunks, with their state).
        whole = limit * self.chunk if self.state_groups else len(prompt) // self.block_size * self.block_size
        want = min(whole, len(prompt) - 1)
        if self.producer_wait.holds(request, max(hit_tokens, num_computed_tokens), want):
            if self.hit_cache is not None:  # the misses that ended the hit are asked again
                tails = [TAIL_TAG + h for h in self._tails(state, hit)]
                self.hit_cache.invalidate(state.hashes[hit:] + tails)
            return None, False
        self.counters["queried_tokens"] += len(prompt)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        if self.planner is not None:
            hit_tokens = self._plan_load(state, found.tiers, num_computed_tokens, hit_tokens)
            if hit_tokens <= num_computed_tokens:
                return 0, False  # faster to compute: vLLM computes it (and its chunks stay saved)
        self.counters["hit_tokens"] += hit_tokens - num_computed_tokens
        state.load_async = self.async_load and hit_tokens - num_computed_tokens >= self.async_min_tokens
        return hit_tokens - num_computed_tokens, state.load_async

    def _plan_load(self, state: _Request, tiers: tuple[int, ...], computed: int, end: int) -> int:
        """Where the load of the hit [computed, end) ends: the prefix the load planner says
        pays. A cut hit ends on a chunk boundary; the chunks after it stay in the pool."""
        cut, state.load_tiers = self.planner.plan_hit(computed, self.chunk, tiers, end,
                                                      partial=not self.state_groups)
        if cut < end:
            state.pool_hit, state.tail_hit = cut // self.chunk, None
        start = computed // self.chunk
        loaded_tail = [TAIL_TAG + state.tail_hit[0]] if state.tail_hit is not None else []
        tags = ("", STATE_TAG) if self.state_groups else ("",)
        self.lookups.promoted([t + h for h in state.hashes[start:state.pool_hit] for t in tags] + loaded_tail)
        return cut

    def request_chain(self, request) -> tuple[list[str], KeyExtras | None]:
        """The chunk chain of a request's prompt, and what else names its KV (LoRA adapter,
        cache_salt, multimodal items: keys.request_extras), which its tail hashes reuse."""
        extras = request_extras(request, self.chunk)
        return chunk_hashes(request.prompt_token_ids or [], self.chunk, extras), extras

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None or num_external_tokens == 0:
            return
        groups = blocks.get_block_ids()
        local = state.local_tokens
        end = local + num_external_tokens
        first_block = local // self.block_size
        bpc = self.blocks_per_chunk
        rid = request.request_id
        lossless = self.cfg.lossless or marked(request, LOSSLESS)
        for g, kind in enumerate(self.kinds):
            if kind == STATE:  # vLLM reads a hit's state from the block of its last token
                state.pending_load.append(ChunkLoad(rid, g, state.hashes[end // self.chunk - 1],
                                                    [groups[g][(end - 1) // self.block_size]],
                                                    lossless=lossless))
                continue
            for c in range(local // self.chunk, -(-end // self.chunk)):
                lo = max(c * bpc, first_block)
                chunk_hash, n = (state.hashes[c], bpc) if c < state.pool_hit else state.tail_hit
                state.pending_load.append(ChunkLoad(rid, g, chunk_hash, groups[g][lo:c * bpc + n],
                                                    skip=lo - c * bpc, object_blocks=n, lossless=lossless))
        if state.load_async:  # the request now waits in WAITING_FOR_REMOTE_KVS
            self._async_ready.append(rid)

    # -- per step -------------------------------------------------------------
    def build_connector_meta(self, scheduler_output) -> StepMetadata:
        self._step += 1
        meta = StepMetadata(new_tokens=scheduler_output.total_num_scheduled_tokens,
                            full_graph=self.full_graph(scheduler_output), step=self._step)
        if self.lookups is not None:  # the step's lookups go to the pool now, in one call
            self.counters["max_lookup_rpcs_per_step"] = max(self.counters["max_lookup_rpcs_per_step"],
                                                            self.lookups.flush())
        for req_id in self.compaction.planned(scheduler_output) & self._reqs.keys():
            self._reqs[req_id].compacted = True
        for rid in self._async_ready:
            state = self._reqs.get(rid)
            if state is not None:
                meta.async_loads.extend(state.pending_load)
                state.async_blocks = {b for ld in state.pending_load for b in ld.block_ids}
                state.pending_load, state.load_tiers = [], None  # off the step: no step timing
        self._async_ready = []
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(ids) for ids in new.block_ids]
            self._start_loads(state, meta)
            self._plan_saves(new.req_id, state, new.num_computed_tokens
                             + scheduler_output.num_scheduled_tokens[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                state.block_ids = [list(ids) for ids in new_blocks] if new_blocks else []
                self._start_loads(state, meta)
            elif new_blocks:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_blocks]
                for ids, more in zip(state.block_ids, new_blocks):
                    ids.extend(more)
            self._plan_saves(req_id, state, cached.num_computed_tokens[i]
                             + scheduler_output.num_scheduled_tokens[req_id], meta)
        if self.planner is not None:
            self.planner.step_built(self._step, meta.new_tokens)
        return meta

    def _start_loads(self, state: _Request, meta: StepMetadata) -> None:
        meta.loads.extend(state.pending_load)
        state.pending_load = []
        if state.load_tiers is not None:  # what the step loads from each tier, for the planner
            self.planner.loading(state.load_tiers)
            state.load_tiers = None

    def _plan_saves(self, req_id: str, state: _Request, computed_after_step: int,
                    meta: StepMetadata) -> None:
        if not self.can_save:
            return
        if state.compacted or is_compacted(state.request):
            self.counters["compacted_skips"] += 1
            return
        if self.commit_before_reply and not state.prompt_done \
                and computed_after_step >= len(state.request.prompt_token_ids or []):
            state.prompt_done = meta.commit_now = True
        if self.decode_chain is not None:
            state.hashes = self.decode_chain.extend(state.request, state.hashes, state.extras,
                                                    computed_after_step)
        done = min(len(state.hashes), computed_after_step // self.chunk)
        bpc = self.blocks_per_chunk
        saved = []
        for g, kind in enumerate(self.kinds):
            if kind == ATTN:
                for c in range(state.saved_chunks, done):
                    meta.saves.append(ChunkSave(req_id, g, state.hashes[c],
                                                state.block_ids[g][c * bpc:(c + 1) * bpc]))
            elif computed_after_step == done * self.chunk and done > state.pool_hit:
                # The step ends on a chunk boundary: its block holds the state there.
                block = state.block_ids[g][(computed_after_step - 1) // self.block_size]
                if block:  # 0 is vLLM's null block: no state kept there
                    meta.saves.append(ChunkSave(req_id, g, state.hashes[done - 1], [block]))
                    saved.append(STATE_TAG + state.hashes[done - 1])
        if self.kv_events is not None and done > state.saved_chunks:  # in vLLM's block hashes
            self.kv_events.planned(state.request, [(state.hashes[c], c * self.chunk, (c + 1) * self.chunk)
                                                   for c in range(state.saved_chunks, done)])
        tail = self._plan_tail(req_id, state, computed_after_step, meta)
        if self.hit_cache is not None:  # a cached miss must not hide what we now save
            self.hit_cache.invalidate(state.hashes[state.saved_chunks:done] + saved
                                      + ([TAIL_TAG + tail] if tail is not None else []))
        state.saved_chunks = max(state.saved_chunks, done)
        if saved:
            state.pool_hit = done

    def _plan_tail(self, req_id: str, state: _Request, computed_after_step: int, meta: StepMetadata):
        """Once the whole prompt is computed: save its whole blocks past the last full
        chunk as one partial object (dense models). Returns its hash when planned."""
        prompt = state.request.prompt_token_ids or []
        if self.state_groups or state.tail_saved or computed_after_step < len(prompt):
            return None
        state.tail_saved = True
        done = len(prompt) // self.chunk
        n = len(prompt) // self.block_size - done * self.blocks_per_chunk
        if n <= 0:
            return None
        tails = self._tails(state, done)
        if len(tails) < n:
            return None
        tail = tails[n - 1]
        first = done * self.blocks_per_chunk
        for g, kind in enumerate(self.kinds):
            meta.saves.append(ChunkSave(req_id, g, tail, state.block_ids[g][first:first + n]))
        if self.kv_events is not None:
            self.kv_events.planned(state.request, [(tail, done * self.chunk, (first + n) * self.block_size)])
        return tail

    def update_connector_output(self, connector_output) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None) or set()
        for rid in getattr(connector_output, "finished_recving", None) or ():
            state = self._reqs.get(rid)
            if state is not None:  # a failed load's objects may still exist: no retry loop
                state.load_failed, state.async_blocks = bool(state.async_blocks & invalid), set()
        report = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(report, WorkerReport):
            return
        if self.planner is not None:
            self.planner.steps_timed(report.steps)
        failed = report.failed_chunks
        if self.hit_cache is not None:
            self.hit_cache.invalidate(failed + [tag + h for tag in (STATE_TAG, TAIL_TAG) for h in failed])
        if self.kv_events is not None:  # a store without an event log: are they gone?
            self.kv_events.failed(failed)

    def take_events(self) -> list:
        return self.kv_events.take() if self.kv_events is not None else []

    def request_finished(self, request) -> tuple[bool, None]:
        state = self._reqs.pop(request.request_id, None)
        if state is not None and self.lookups is not None:
            self.lookups.forget(state.lookup)
        self.producer_wait.forget(request.request_id)
        return False, None

    def stats(self) -> AscendStoreStats:
        if self.hit_cache is not None:
            for k, v in self.hit_cache.counters.items():
                self.counters[k] = v
        if self.planner is not None:
            self.planner.report()
        return AscendStoreStats(self.counters.take())

    def shutdown(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
        if self.backend is not None:
            self.backend.close()
