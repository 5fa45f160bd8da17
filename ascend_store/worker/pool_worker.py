"""Worker half: registers vLLM's KV caches and answers vLLM's per-step worker hooks.

The moving of bytes lives beside it: ``loads.py`` (a step's pool hits into the cache,
layer by layer) and ``saves.py`` (a step's new chunks into the pool), sharing the
registered layers and the pool through ``worker_context.WorkerContext``. This module
keeps what spans both: registration (``registration.py`` turns the caches into layer
parts and object formats; here the batched copy path and the self-test are set up), the
hybrid models' deferred state copies, and the per-step bookkeeping the tests read.
With ``use_layerwise: false`` the same jobs run whole: the load before the forward, the
save after it; so does every step that vLLM may run as one full CUDA/ACL graph (uniform
decodes: a full pool hit computes one token), whose replay calls no per-layer hook.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from ascend_store.backends import BackendUnavailable, create_backend
from ascend_store.common import seams
from ascend_store.common.codecs import get_codec
from ascend_store.common.config import StoreConfig
from ascend_store.common.keys import KeySpace, identity_from_vllm
from ascend_store.common.layers import STATE, group_kinds, layer_ids
from ascend_store.common.metadata import StepMetadata, WorkerReport
from ascend_store.common.parallel import sharding
from ascend_store.common.transfer import LayerLayout
from ascend_store.device.device_path import DevicePath
from ascend_store.device.platform import PinError, batched_copies
from ascend_store.ops.stats import AscendStoreStats, IntervalCounters, PoolOccupancy, StepCalls
from ascend_store.worker import selftest
from ascend_store.worker.async_loads import AsyncLoads
from ascend_store.worker.hybrid import DeferredStateCopies, state_layout
from ascend_store.worker.loads import Loader
from ascend_store.worker.registration import checked_layout, layer_parts, object_formats
from ascend_store.worker.saves import Saver
from ascend_store.worker.step_timer import StepTimer
from ascend_store.worker.worker_context import WorkerContext

log = logging.getLogger("ascend_store")


def _ranks() -> tuple[int, int]:
    """This worker's (TP rank, pipeline stage)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
    except (AssertionError, ImportError):  # no TP group (single process tools, tests)
        return 0, 0


def _has_preemption_hook() -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    if hasattr(KVConnectorBase_V1, "handle_preemptions"):
        return True
    log.warning("this vLLM has no handle_preemptions hook: saves drain inside each step")
    return False


def zeroes_new_blocks(kv_cache_config) -> bool:
    """Whether vLLM zeroes a step's new blocks on the compute stream after
    ``handle_preemptions`` (hybrid models, mixed precisions): a load started before then
    could be wiped. A vLLM without the property zeroes nothing."""
    return bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))


class PoolWorker:
    def __init__(self, vllm_config, kv_cache_config, cfg: StoreConfig, kv_role: str):
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.block_size = vllm_config.cache_config.block_size
        self.blocks_per_chunk = cfg.chunk_tokens(self.block_size) // self.block_size
        self.codec = get_codec(cfg.codec)
        self.kv_specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self.layer_ids = layer_ids(kv_cache_config)
        kinds = group_kinds(kv_cache_config)
        self.sharding = sharding(vllm_config, cfg.head_slices, STATE in kinds, cfg.layer_slices,
                                 len(kinds) == 1)
        identity = identity_from_vllm(vllm_config, self.blocks_per_chunk * self.block_size, cfg.codec,
                                      self.sharding)
        self.tp_rank, self.pp_rank = _ranks()
        tp_rank = self.tp_rank
        # What this rank stores and loads (parallel.py): its shard or head slices, of its
        # stage or of the layer spans inside its stage.
        ns, sh = identity.namespace(), self.sharding
        self.keyspaces = [KeySpace(ns, shard, span) for span in sh.spans(self.pp_rank)
                          for shard in sh.shards(tp_rank)]
        # Linear-attention layers: one state object per chunk boundary, always raw bytes.
        self.state_layers = {n for n, (g, _) in self.layer_ids.items() if kinds[g] == STATE}
        self.num_blocks = kv_cache_config.num_blocks
        self.zeroes_new_blocks = zeroes_new_blocks(kv_cache_config)
        self.backend = create_backend(cfg, role="worker")
        self.counters = IntervalCounters()
        self.ctx = WorkerContext(
            cfg, self.backend, self.counters, self.blocks_per_chunk, self.state_layers,
            {n: get_codec("raw") if n in self.state_layers else self.codec for n in self.layer_ids})
        if self.sharding.replicated:  # MLA: one copy of each chunk for all TP ranks
            self.ctx.writer = (tp_rank, self.sharding.tp_size)
        self.loader = Loader(self.ctx)
        self.async_loads = AsyncLoads(self.ctx)
        self.saver = Saver(self.ctx, cfg.defer_save_drain and _has_preemption_hook())
        self.state_copies: DeferredStateCopies | None = None
        self.parts: dict[str, list[str]] = {}  # layer -> its parts (tuple caches, head slices)
        self._step_loads = False
        self._begun: StepMetadata | None = None  # the step whose loads started
        self._waited: set[str] = set()
        self.load_step_layers: deque[int] = deque(maxlen=4096)  # layers that waited, per loading step
        self.occupancy = PoolOccupancy(self.backend, self.counters)  # pool gauges, off the engine's thread
        self.step_calls = StepCalls(self.counters)
        self.step_hooks: deque[tuple[int, int]] = deque(maxlen=4096)  # (waits, saves) per step
        self.step_timer = StepTimer() if cfg.load_planner else None  # for the scheduler's planner
        self._waits = self._saves = 0
        self._rpcs_seen = 0

    @property
    def order(self) -> list[str]:
        return self.ctx.order

    @property
    def device_path(self) -> DevicePath | None:
        return self.ctx.device_path

    # -- setup ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ctx = self.ctx
        for name, tensor in kv_caches.items():
            if name not in self.layer_ids:
                raise ValueError(f"KV cache layer {name!r} is not in the KV cache config")
            if name in self.state_layers:
                views = (list(tensor) if isinstance(tensor, (list, tuple))
                         else seams.state_views(self.vllm_config, name))
                ctx.layouts[name] = state_layout(views, self.num_blocks)
                continue
            spec = self.kv_specs[self.layer_ids[name][0]]
            parts = layer_parts(name, tensor, spec, self.sharding, self.tp_rank, self.num_blocks)
            self.parts[name] = [p for p, _, _ in parts]
            for part, t, dims in parts:
                ctx.layouts[part] = checked_layout(part, t, self.num_blocks, dims, self.codec)
                ctx.codecs[part] = self.codec
        ctx.order = [p for n in self.layer_ids for p in self.parts.get(n, (n,)) if p in ctx.layouts]
        ctx.rank = {name: r for r, name in enumerate(ctx.order)}
        object_formats(ctx, self.keyspaces, self.layer_ids, len(self.kv_specs), self.sharding, self.pp_rank)
        states = {n: ctx.layouts[n] for n in ctx.order if n in self.state_layers}
        first = ctx.layouts[next(n for n in ctx.order if n not in states)]
        log.info("ascend-store: %d layers (%d with recurrent state) in %d chunk objects per chunk, page "
                 "%s (%d bytes), %d blocks per chunk, keys %s", len(ctx.order), len(states), len(ctx.groups),
                 first.describe(), first.page_bytes, self.blocks_per_chunk, self.keyspaces[0].namespace)
        if states:
            self._install_hybrid(states)
        device = ctx.layouts[ctx.order[0]].tensor.device
        if batched_copies(self.cfg.copy_path, device) and self.codec.name in DevicePath.CODECS:
            try:
                ctx.device_path = DevicePath(device, ctx.layouts, ctx.codecs)
                ctx.device_path.warm_up()
            except ValueError as exc:  # an unaligned layout: per-block copies still work
                log.warning("ascend-store: batched device copies off (%s); copying block by block", exc)
        if ctx.device_path is not None:
            try:  # pinning a large arena takes seconds: at startup, not in the first request
                ctx.arena()
            except BackendUnavailable:
                pass  # the pool is not up yet: pinned on first use
            except PinError as exc:  # an accelerator without pinning must still start
                log.warning("ascend-store: pinning the pool's memory failed (%s); copying block by block",
                            exc)
                ctx.device_path = None
        log.info("ascend-store: copy path %s on %s", "batched" if ctx.device_path else "per_block", device)
        ctx.backend = selftest.checked_pool(ctx, self.num_blocks)  # no pool if a block comes back wrong

    def _install_hybrid(self, states: dict[str, LayerLayout]) -> None:
        """Make linear-attention layers drive the layer protocol and defer the runner's
        align-mode state copy (seams.py); refuse to start if this vLLM lacks a seam."""
        ops = seams.install_state_ops()
        if not ops:
            raise seams.SeamError("no linear-attention op of this vLLM could be hooked; the pool "
                                  "cannot serve this hybrid model (docs/hybrid.md)")
        self.state_copies = DeferredStateCopies(states)
        seams.install_state_copy(self._take_state_copies)
        log.info("ascend-store: hybrid model, layer protocol on ops %s", ", ".join(ops))

    def _take_state_copies(self, copy_bufs) -> bool:
        """The runner's align-mode copies of this step: ours to run after the loads when
        this step loads, vLLM's to run now otherwise."""
        if not (self._step_loads and self.cfg.defer_state_copy and copy_bufs.offset):
            return False
        self.state_copies.take(*seams.copy_plan(copy_bufs))
        self.counters["deferred_state_copies"] += copy_bufs.offset
        return True

    def _run_state_copies(self, layer: str | None = None) -> None:
        """Deferred copies of ``layer`` (of every layer when None), once its state landed."""
        if self.state_copies is None:
            return
        if layer is None:
            self.state_copies.run_all()
        else:
            self.state_copies.run(layer)

    # -- loads ----------------------------------------------------------------
    def handle_preemptions(self, meta: StepMetadata | None = None) -> None:
        if self.step_timer is not None:
            self.step_timer.begin(meta)
        self.saver.drain()
        # vLLM queues the hybrid state copy after this call and before start_load_kv.
        self._step_loads = bool(meta is not None and getattr(meta, "loads", None))
        if isinstance(meta, StepMetadata) and self.starts_early():
            # vLLM's runner calls this first in the step, then prepares its inputs (6 ms
            # at 32K tokens): the step's loads start now, so the link runs meanwhile.
            self._begin(meta)

    def start_at_schedule(self, meta: StepMetadata) -> None:
        """The scheduler half of this process, as it builds a step's metadata (connector.py):
        where loads start early they start here, before vLLM's runner prepares its inputs
        (8 ms at 32K tokens; the V2 runner calls every worker hook after that). The last
        step's saves drain first, as at any step's start."""
        if (meta.loads or meta.async_loads) and self.starts_early():
            if self.step_timer is not None:
                self.step_timer.begin(meta)
            self.saver.drain()
            self._begin(meta)
            self.counters["loads_started_at_schedule"] += 1

    def start_load_kv(self, meta: StepMetadata) -> None:
        if self.step_timer is not None:
            self.step_timer.begin(meta)
        self.saver.drain()
        job = self._begin(meta)
        if job is not None and not self.by_layer(meta):
            self.loader.finish(job, before_forward=True)
            self.counters["loads_before_forward"] += 1
            self._run_state_copies()

    def by_layer(self, meta: StepMetadata | None) -> bool:
        """Whether a step's loads and saves go layer by layer: not in whole mode, nor in a
        step vLLM may run as one full graph (its replay calls no per-layer hook). Read from
        each hook's metadata: vLLM 0.32 calls ``start_load_kv`` after the forward in a step
        without loads, so no state set there may steer that step's saves."""
        return self.cfg.use_layerwise and not getattr(meta, "full_graph", False)

    def starts_early(self) -> bool:
        """Loads start in ``handle_preemptions`` only where a copy engine moves them beside
        the host's work, and only when vLLM does not zero the step's new blocks after that
        hook (the load stream follows the compute stream's work queued when the load
        starts: from ``start_load_kv`` that includes the zeroing). The host path's copies
        would take the same cores (and the GIL) from the runner's input preparation, and
        would race a hybrid model's state copy that vLLM queues in between."""
        dp = self.ctx.device_path
        return dp is not None and dp.dev.is_accelerator and not self.zeroes_new_blocks

    def _begin(self, meta: StepMetadata):
        """Start the step's loads once (from whichever hook comes first); the job or None."""
        if meta is self._begun:
            return self.loader.job if meta.loads else None
        self._begun = meta
        self.counters["steps"] += 1
        if meta.async_loads:
            self.async_loads.start(meta.async_loads)
        return self.loader.start(meta.loads, meta.new_tokens) if meta.loads else None

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._waits += 1
        self._waited.add(layer_name)
        job = self.loader.job
        if job is None or not self.by_layer(self._begun):
            return
        for part in self.parts.get(layer_name, (layer_name,)):
            self.loader.wait(part)
        if layer_name in self.state_layers:
            self._run_state_copies(layer_name)

    def get_finished(self) -> tuple[None, set[str] | None]:
        return None, self.async_loads.finished() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.loader.errors() | self.async_loads.errors()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        failed = self.loader.take_failed_chunks() + self.async_loads.take_failed_chunks()
        steps = self.step_timer.take() if self.step_timer is not None else {}
        return WorkerReport(failed, steps) if failed or steps else None

    # -- saves ----------------------------------------------------------------
    def save_kv_layer(self, layer_name: str, meta: StepMetadata | None) -> None:
        self._saves += 1
        if self.by_layer(meta):
            for part in self.parts.get(layer_name, (layer_name,)):
                self.saver.save_layer(part, meta.saves if meta is not None else None)

    def wait_for_save(self, meta: StepMetadata | None) -> None:
        self.saver.drain()
        if self.state_copies is not None and self.state_copies.pending:
            # A state layer never waited for its load: its kernel read the state before
            # the copy, so this step's tokens are wrong. A vLLM seam moved: stop loudly.
            raise seams.SeamError("ascend-store: deferred state copies of layers "
                                  f"{self.state_copies.outstanding()} never ran (docs/hybrid.md)")
        if self._waits or self._saves:
            self.step_hooks.append((self._waits, self._saves))
        if self._step_loads:
            self.load_step_layers.append(len(self._waited))
        self._waits = self._saves = 0
        self._waited = set()
        if self.step_timer is not None:
            self.step_timer.end(meta)
        self._begun = None
        rpcs = self.backend.rpcs
        self.counters["max_rpcs_per_step"] = max(self.counters["max_rpcs_per_step"], rpcs - self._rpcs_seen)
        self._rpcs_seen = rpcs
        self.step_calls.end_step(self.backend.calls)
        # commit_now: the reply leaves after this step, so its objects are published first.
        self.saver.end_step(meta.saves if meta is not None else None, whole=not self.by_layer(meta),
                            publish=meta is not None and meta.commit_now)

    def stats(self) -> AscendStoreStats:
        self.occupancy.poll()
        self.counters["rpcs"] = self.backend.rpcs
        return AscendStoreStats(self.counters.take())

    def shutdown(self) -> None:
        self.saver.shutdown()
        self.loader.shutdown()
        self.async_loads.shutdown()
        self.occupancy.close()
        self.ctx.drop_arena()
        if self.ctx.device_path is not None:
            self.ctx.device_path.close()
        self.backend.close()
