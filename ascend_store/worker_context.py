"""What the worker's load and save paths share: the registered layers, the pool, the
pool's memory as a tensor, and the naming of each (layer, chunk) object."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ascend_store.backends import Backend
from ascend_store.config import StoreConfig
from ascend_store.device_path import DevicePath
from ascend_store.stats import IntervalCounters
from ascend_store.transfer import LayerLayout, object_bytes


@dataclass
class WorkerContext:
    cfg: StoreConfig
    backend: Backend
    counters: IntervalCounters
    blocks_per_chunk: int
    state_layers: set[str]  # linear-attention layers: one state object per chunk boundary
    codecs: dict[str, object]  # layer -> codec
    layouts: dict[str, LayerLayout] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # registered layers, in model order
    prefixes: dict[str, tuple[int, str]] = field(default_factory=dict)  # layer -> (group, key prefix)
    device_path: DevicePath | None = None  # the batched copy path, when on
    _arena: tuple[str, torch.Tensor] | None = None

    def arena(self) -> torch.Tensor:
        """The pool's memory as a uint8 tensor (pinned on accelerators), remapped when the
        pool restarted."""
        epoch, view = self.backend.buffer()
        if self._arena is None or self._arena[0] != epoch:
            arena = (self.device_path.arena(epoch, view) if self.device_path is not None
                     else torch.frombuffer(view, dtype=torch.uint8))
            self._arena = (epoch, arena)
        return self._arena[1]

    def drop_arena(self) -> None:
        self._arena = None

    def plan(self, chunks: list) -> list[tuple[str, int, str]]:
        """(layer, index into ``chunks``, key) of every object of ``chunks`` (loads or
        saves), layer by layer in model order."""
        return [(name, j, prefix + c.chunk_hash) for name, (group, prefix) in self.prefixes.items()
                for j, c in enumerate(chunks) if c.group == group]

    def object_blocks(self, name: str) -> int:
        return 1 if name in self.state_layers else self.blocks_per_chunk

    def object_bytes(self, name: str) -> int:
        return object_bytes(self.layouts[name], self.object_blocks(name), self.codecs[name])
