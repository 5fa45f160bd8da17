"""Per-step messages from the scheduler half to the worker half.

Plain dataclasses of ints and strings: vLLM ships them to worker processes as-is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class ChunkLoad:
    """Load pages ``skip..skip+len(block_ids)`` of one chunk object of ``object_blocks``
    blocks into ``block_ids`` (the first ``skip`` pages are already in the device cache
    and are left alone; pages past the end are not needed)."""

    req_id: str
    group: int
    chunk_hash: str
    block_ids: list[int]
    skip: int = 0
    object_blocks: int = 0  # 0: skip + len(block_ids)
    lossless: bool = False  # refuse an object a lossy tier gave back (FLAG_LOSSY)

    def __post_init__(self):
        if not self.object_blocks:
            self.object_blocks = self.skip + len(self.block_ids)


@dataclass
class ChunkSave:
    """Publish one full chunk, whose pages sit in ``block_ids``, under ``chunk_hash``."""

    req_id: str
    group: int
    chunk_hash: str
    block_ids: list[int]


@dataclass
class StepMetadata(KVConnectorMetadata):
    loads: list[ChunkLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    # Loads of requests waiting in WAITING_FOR_REMOTE_KVS: run off the step, reported
    # through get_finished (async_loads.py).
    async_loads: list[ChunkLoad] = field(default_factory=list)
    # A prompt completes in this step on a producer: commit its saves before the step
    # returns, so the reply cannot overtake them.
    commit_now: bool = False
    new_tokens: int = 0  # tokens the step computes (how far loads are queued ahead: loads.py)
    # vLLM may replay one full CUDA/ACL graph for this step (pool_scheduler.py): no per-layer
    # hook runs inside it, so its loads land before the forward and its saves queue after.
    full_graph: bool = False
    step: int = 0  # the scheduler's count: the worker's timing of the step names it (planner.py)


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler, per step: chunks whose load failed (missing or corrupt), so
    the scheduler's lookup cache stops calling them hits; with ``load_planner``, the
    seconds each finished step took, by step number (the slowest rank's)."""

    failed_chunks: list[str] = field(default_factory=list)
    steps: dict[int, float] = field(default_factory=dict)

    def aggregate(self, other: "WorkerReport") -> "WorkerReport":
        steps = dict(self.steps)
        for step, seconds in other.steps.items():
            steps[step] = max(seconds, steps.get(step, 0.0))
        return WorkerReport(sorted(set(self.failed_chunks) | set(other.failed_chunks)), steps)
