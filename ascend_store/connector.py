"""``AscendStoreConnector``: the class vLLM loads. It routes to one half per role, and
passes each step's metadata from the scheduler half to the worker half where both live in
one process (vLLM's single-process executor), so the step's loads can start before vLLM's
runner prepares its inputs.

    --kv-transfer-config '{"kv_connector": "AscendStoreConnector",
                           "kv_connector_module_path": "ascend_store.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"backend": "local"}}'
"""

from __future__ import annotations

import weakref
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from ascend_store.common.config import StoreConfig, check_transfer_config
from ascend_store.common.layers import group_kinds
from ascend_store.ops.stats import AscendStorePromMetrics, AscendStoreStats

# engine_id -> the worker half in this process. vLLM's single-process executor (one
# GPU/NPU, the default there) runs the worker in the engine core's thread, right after the
# scheduler: the scheduler half hands it each step's metadata as soon as it is built.
_LOCAL_WORKERS: dict[str, weakref.ref] = {}
_NOBODY = weakref.ref(set())  # a dead reference


class AscendStoreConnector(KVConnectorBase_V1, SupportsHMA):
    is_ascend_store = True  # what seams.py's wrappers look for

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        cfg = check_transfer_config(ktc, str(vllm_config.device_config.device_type))
        if kv_cache_config is not None:
            group_kinds(kv_cache_config)
        self.scheduler = self.worker = None
        if role == KVConnectorRole.SCHEDULER:
            from ascend_store.scheduler.pool_scheduler import PoolScheduler

            self.scheduler = PoolScheduler(vllm_config, kv_cache_config, cfg, ktc.kv_role)
        else:
            from ascend_store.worker.pool_worker import PoolWorker

            self.worker = PoolWorker(vllm_config, kv_cache_config, cfg, ktc.kv_role)
            other = _LOCAL_WORKERS.get(ktc.engine_id, _NOBODY)()
            # Two live engines of one process sharing an engine_id: neither gets the hand-over.
            _LOCAL_WORKERS[ktc.engine_id] = _NOBODY if other is not None else weakref.ref(self.worker)
        self.engine_id = ktc.engine_id

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """No: vLLM keeps its full graphs. A full CUDA/ACL graph's replay runs no Python, so
        no ``wait_for_layer_load`` or ``save_kv_layer``; the scheduler marks each step vLLM
        may replay that way (uniform decodes, which a full pool hit is), and the worker
        loads such a step whole before the forward and saves it after. Other steps run
        PIECEWISE graphs, with the per-layer hooks between the pieces. vLLM asks this
        while it resolves its config: a misspelt key fails here, named."""
        StoreConfig.parse(extra_config)
        return False

    # A dropped save is a future miss, not lost data: nothing must wait for delivery.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # -- scheduler side -------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = self.scheduler.build_connector_meta(scheduler_output)
        worker = _LOCAL_WORKERS.get(self.engine_id, _NOBODY)()
        if worker is not None:  # the runner's input preparation comes before any worker hook
            worker.start_at_schedule(meta)
        return meta

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def take_events(self):
        return self.scheduler.take_events()

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    # -- worker side ----------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        self.worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        self.worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        if self._connector_metadata is not None:  # none while a graph is captured
            self.worker.save_kv_layer(layer_name, self._connector_metadata)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]):
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self.worker.build_connector_worker_meta()

    # -- stats (both sides) ----------------------------------------------------
    def get_kv_connector_stats(self):
        return (self.scheduler or self.worker).stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return AscendStoreStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return AscendStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None and _LOCAL_WORKERS.get(self.engine_id, _NOBODY)() is self.worker:
            del _LOCAL_WORKERS[self.engine_id]
        half = self.scheduler or self.worker
        if half is not None:
            half.shutdown()
