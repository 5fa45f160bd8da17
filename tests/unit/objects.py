"""Test helpers: one pool object checked and decoded the way the worker does it in bulk
(transfer.header_faults + decode_object)."""

from __future__ import annotations

import torch

from ascend_store.transfer import CorruptObject, LayerLayout, decode_object, header_faults


def check_header(obj: torch.Tensor, layout: LayerLayout, key: str, blocks_per_chunk: int, checksum: bool,
                 codec) -> int:
    """``header_faults`` for one object, raising CorruptObject; returns the payload length."""
    host = obj.numpy()
    faults, h = header_faults(host, [0], [host.size], [key], layout, blocks_per_chunk, checksum, codec)
    if faults[0] is not None:
        raise CorruptObject(faults[0])
    return int(h["payload"][0])


def read_object(obj: torch.Tensor, layout: LayerLayout, block_ids: list[int], skip: int, key: str,
                blocks_per_chunk: int, checksum: bool, codec) -> None:
    """Check ``obj`` against ``key``, the layout and the codec, then decode pages
    ``skip..`` into ``block_ids``."""
    n = check_header(obj, layout, key, blocks_per_chunk, checksum, codec)
    decode_object(obj, n, layout, block_ids, skip, key, blocks_per_chunk, codec)
