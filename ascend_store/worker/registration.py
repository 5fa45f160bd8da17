"""Registration: how the KV cache tensors vLLM hands a worker become the pool's layer parts
and chunk object formats.

A layer is one part, or several: vllm-ascend hands tuples (K and V split, MLA's nope and
rope parts, a sparse-attention layer's indexer cache), and with head slices each slice of
a tensor is a part of its slice's object. Each part gets a ``LayerLayout`` (how its blocks
are addressed) that the codec accepts; a tensor the pool cannot address stops the engine
here, naming the part. Parts of one KV cache group that belong to one key space (a TP
shard or head slice, a layer span) form one object format (``GroupFormat``): the pages of
a chunk, part after part, in one pool object.
"""

from __future__ import annotations

import torch

from ascend_store.common.codecs import Codec
from ascend_store.common.config import ConfigError
from ascend_store.common.keys import KeySpace
from ascend_store.common.parallel import Sharding, head_slices
from ascend_store.common.transfer import LayerLayout
from ascend_store.worker.worker_context import GroupFormat, WorkerContext

Part = tuple[str, torch.Tensor, "tuple | None"]  # (part name, tensor, KV dims (heads, block, head size))


def layer_of(part: str) -> str:
    """The vLLM layer a part belongs to (``{layer}#...``)."""
    return part.split("#", 1)[0]


def layer_parts(name: str, tensor, spec, sharding: Sharding, tp_rank: int, num_blocks: int) -> list[Part]:
    """The parts of a layer. vLLM hands one tensor per layer; vllm-ascend a tuple: (K, V)
    split caches, MLA's (nope, rope) with different last dims, or more (an indexer cache):
    each tensor is its own part of the chunk object, ``{layer}#{i}``. With head slices each
    slice is a part ``{layer}#h{j}of{S}`` (``{layer}#{i}#h{j}of{S}``) of its slice's object."""
    dims = tuple(getattr(spec, a, None) for a in ("num_kv_heads", "block_size", "head_size"))
    dims = None if None in dims else dims
    tensors = list(tensor) if isinstance(tensor, (list, tuple)) else None
    if not sharding.slices:
        if tensors is None:
            return [(name, tensor, dims)]
        return [(f"{name}#{i}", t, None) for i, t in enumerate(tensors)]  # dims: a whole page's
    # Each tensor's slices; a tuple cache's K and V of a slice both go into its object.
    shards = sharding.shards(tp_rank)
    named = [(name, tensor)] if tensors is None else [(f"{name}#{i}", t) for i, t in enumerate(tensors)]
    part_dims = (dims[0] // len(shards), *dims[1:]) if tensors is None else None
    return [(f"{part}#{s}", v, part_dims) for part, t in named
            for s, v in zip(shards, head_slices(t, num_blocks, dims, len(shards)))]


def checked_layout(part: str, tensor: torch.Tensor, num_blocks: int, dims, codec: Codec) -> LayerLayout:
    """The part's layout, refused with the part's name where the pool cannot address it or
    the codec cannot encode it."""
    try:
        layout = LayerLayout.of(tensor, num_blocks, dims)
    except ValueError as exc:
        raise ValueError(f"ascend-store cannot store KV cache {part}: {exc}") from None
    try:
        codec.check(layout)
    except ValueError as exc:
        raise ValueError(f"ascend-store codec {codec.name!r} cannot store {part}: {exc}") from None
    return layout


def holds(sharding: Sharding, layer_ids: dict[str, tuple[int, int]], ks: KeySpace, part: str) -> bool:
    """Whether a layer part goes into ``ks``'s objects: its head slice (parts end in
    ``#h{j}of{S}``) and its layer span (``L{first}-{last}``)."""
    if sharding.slices and not part.endswith("#" + ks.shard):
        return False
    if sharding.layer_slices:
        first, last = map(int, ks.span[1:].split("-"))
        return first <= layer_ids[layer_of(part)][1] <= last
    return True


def object_formats(ctx: WorkerContext, keyspaces: list[KeySpace], layer_ids: dict[str, tuple[int, int]],
                   num_groups: int, sharding: Sharding, pp_rank: int) -> None:
    """One object format per (KV cache group, key space) into ``ctx.groups``, and each
    part's (format, index) into ``ctx.group_of``."""
    held = {layer_ids[layer_of(p)][0] for p in ctx.order}
    empty = sorted(set(range(num_groups)) - held)
    if empty:  # the scheduler asks every stage for every group's object
        raise ConfigError(f"ascend-store: KV cache groups {empty} have no layer on pipeline stage "
                          f"{pp_rank}; choose a pipeline split that gives every stage "
                          "layers of every group (docs/parallel.md)")
    n = len(keyspaces)
    for g in sorted(held):
        for k, ks in enumerate(keyspaces):
            names = [p for p in ctx.order
                     if layer_ids[layer_of(p)][0] == g and holds(sharding, layer_ids, ks, p)]
            if not names:
                raise ConfigError(f"ascend-store: no layer of KV cache group {g} on this rank belongs in "
                                  f"{ks.prefix(g)} (docs/parallel.md)")
            ids = [layer_ids[layer_of(p)][1] for p in names]
            labels = [f"{i}{p[len(layer_of(p)):]}" for i, p in zip(ids, names)]  # 7, 7#0, 7#h1of2
            fid = g * n + k
            ctx.groups[fid] = GroupFormat.of(fid, ks.prefix(g), names, labels, ctx.layouts, ctx.codecs,
                                             source=g)
            ctx.group_of.update({p: (fid, i) for i, p in enumerate(names)})
