"""What the worker's load and save paths share: the registered layers, the pool, the
pool's memory as a tensor, and the chunk objects a step's chunks map to.

A chunk object holds one chunk of every registered layer of one KV cache group, layer
after layer (each part: the 32-byte header of transfer.py, then the part's payload):

    [L0 header][L0 payload: n pages][L1 header][L1 payload] ... [Lk header][Lk payload]

So a step asks the pool about one key per chunk, and every per-object quantity (where a
layer's part starts, its size, its expected fingerprint) is a numpy expression over the
step's objects: layer i's part of an object of n blocks starts at
``offset + i * HEADER_BYTES + n * before[i]``. Variable-size codecs (zstd) pack their
parts back to back and are found by walking the headers (their host path only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ascend_store.backends import Backend
from ascend_store.common.config import StoreConfig
from ascend_store.common.transfer import HEADER_BYTES, LayerLayout, fingerprints, layer_salts
from ascend_store.device.device_path import DevicePath
from ascend_store.ops.stats import IntervalCounters


@dataclass
class GroupFormat:
    """The chunk objects of one KV cache group: its layers in object order and where
    each layer's part sits."""

    group: int
    prefix: str  # key prefix: a chunk hash follows
    layers: list[str]
    per_block: np.ndarray  # per layer: payload bytes per block
    before: np.ndarray  # per layer: payload bytes per block of the layers before it
    salts: np.ndarray  # per layer: xor-ed into its parts' fingerprints
    fixed: bool  # fixed-size codec: parts at computable offsets
    source: int  # the vLLM KV cache group whose chunks it holds (a group has one format per shard)
    shapes: list[LayerLayout]  # one layout per distinct page layout of the layers
    shape_of: np.ndarray  # per layer: index into ``shapes``
    codec: str  # the layers' codec, bound into their fingerprints

    @classmethod
    def of(cls, group: int, prefix: str, layers: list[str], ids: list, layouts: dict, codecs: dict,
           source: int | None = None):
        per_block = np.asarray([codecs[n].payload_bytes(layouts[n], 1) for n in layers], dtype=np.int64)
        before = np.concatenate([[0], np.cumsum(per_block)[:-1]]).astype(np.int64)
        tags = [layouts[n].describe() for n in layers]
        first = {t: i for i, t in reversed(list(enumerate(tags)))}  # each tag's first layer
        order = list(first)
        return cls(group, prefix, layers, per_block, before, layer_salts(ids),
                   all(codecs[n].fixed_size for n in layers), group if source is None else source,
                   [layouts[layers[first[t]]] for t in order],
                   np.asarray([order.index(t) for t in tags], dtype=np.int64), codecs[layers[0]].name)

    def size(self, blocks: np.ndarray) -> np.ndarray:
        """Bytes of objects of ``blocks`` blocks (an upper bound for variable codecs)."""
        per_block = int(self.per_block.sum())
        return len(self.layers) * HEADER_BYTES + np.asarray(blocks, dtype=np.int64) * per_block

    def parts(self, offsets: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """[layer, object] arena offset of each layer's part (header included)."""
        i = np.arange(len(self.layers), dtype=np.int64)[:, None]
        return offsets[None, :] + i * HEADER_BYTES + self.before[:, None] * blocks[None, :]

    def part_sizes(self, blocks: np.ndarray) -> np.ndarray:
        return HEADER_BYTES + self.per_block[:, None] * blocks[None, :]

    def fingerprints(self, keys: list[str]) -> np.ndarray:
        """[layer, object] fingerprints of each part: one hash per key and page layout (a
        group's layers share one, a tuple cache's parts may not), a salt per layer."""
        per_shape = np.stack([np.frombuffer(fingerprints(keys, layout, self.codec), dtype="<u8")
                              for layout in self.shapes])
        return per_shape[self.shape_of] ^ self.salts[:, None]


@dataclass
class GroupStep:
    """A step's chunks of one group: which entries (indexes into the step's ChunkLoad or
    ChunkSave list) map to which unique object, and each object's key and block count."""

    fmt: GroupFormat
    entries: np.ndarray
    obj: np.ndarray  # per entry: index into ``keys``
    keys: list[str]
    blocks: np.ndarray  # per object


@dataclass
class WorkerContext:
    cfg: StoreConfig
    backend: Backend
    counters: IntervalCounters
    blocks_per_chunk: int
    state_layers: set[str]  # linear-attention layers: one state block per chunk boundary
    codecs: dict[str, object]  # layer -> codec
    layouts: dict[str, LayerLayout] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)  # registered layers, in model order
    rank: dict[str, int] = field(default_factory=dict)  # layer -> its index in ``order``
    groups: dict[int, GroupFormat] = field(default_factory=dict)  # object formats (group, shard)
    group_of: dict[str, tuple[int, int]] = field(default_factory=dict)  # layer -> (format, index in it)
    device_path: DevicePath | None = None  # the batched copy path, when on
    # (this rank, ranks that share each object): MLA's TP ranks hold the same KV, so
    # each chunk object is written by one of them (picked by its hash) and read by all.
    writer: tuple[int, int] = (0, 1)
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

    def plan(self, chunks: list, dedupe: bool = False) -> list[GroupStep]:
        """The step's chunk objects per group. Requests sharing a prefix name the same
        object: each is leased or reserved once; ``dedupe`` (saves) keeps only the first
        entry of each object, and only objects this rank writes."""
        rank, sharing = self.writer
        if dedupe and sharing > 1:
            chunks = [c if int(c.chunk_hash[:8], 16) % sharing == rank else None for c in chunks]
        out = []
        for fmt in self.groups.values():
            index: dict[str, int] = {}
            entries, obj, blocks = [], [], []
            for j, c in enumerate(chunks):
                if c is None or c.group != fmt.source:
                    continue
                key = fmt.prefix + c.chunk_hash
                k = index.get(key)
                if k is None:
                    k = index[key] = len(index)
                    blocks.append(c.object_blocks if hasattr(c, "object_blocks") else len(c.block_ids))
                elif dedupe:
                    continue
                entries.append(j)
                obj.append(k)
            if entries:
                out.append(GroupStep(fmt, np.asarray(entries, dtype=np.int64),
                                     np.asarray(obj, dtype=np.int64),
                                     list(index), np.asarray(blocks, dtype=np.int64)))
        return out
