"""Test helpers: pool objects checked, decoded, planned and saved one by one, the way the
worker does it in bulk (``check_headers``, ``CopyPlanner``, ``DeviceSaves.finish_saves``)."""

from __future__ import annotations

import numpy as np
import torch

from ascend_store.common.transfer import (
    HEADER_BYTES,
    CorruptObject,
    LayerLayout,
    check_headers,
    decode_object,
    fault_messages,
    fingerprints,
)
from ascend_store.device.segments import CopyPlanner, LayerCopy, PagePlan, StepPages


def header_faults(host: np.ndarray, offsets: list[int], sizes: list[int], keys: list[str],
                  layout: LayerLayout, blocks_per_chunk: int, checksum: bool, codec,
                  wsum_later: bool = False) -> tuple[list[str | None], np.ndarray]:
    """``check_headers`` for objects named by ``keys`` (no layer salt), of at most
    ``blocks_per_chunk`` blocks: a fault message (or None) per object, and the headers."""
    expect = np.frombuffer(fingerprints(keys, layout, codec.name), dtype="<u8")
    limit = np.full(len(offsets), codec.payload_bytes(layout, blocks_per_chunk), dtype=np.int64)
    codes, h = check_headers(host, np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64),
                             expect, limit, checksum, codec, wsum_later)
    return fault_messages(codes, h, sizes, limit, keys.__getitem__), h


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


def plan_objects(plan: PagePlan, objects: list[tuple[int, list[int], int]], load: bool,
                 header: int = HEADER_BYTES) -> LayerCopy:
    """``objects``: (byte offset of the object, block ids, pages to skip); its payload
    starts ``header`` bytes further. A load copies objects -> cache (skipped pages are
    read for the checksum only: dst -1); a save copies cache -> objects."""
    pages = StepPages.of([b for _, b, _ in objects], [k for _, _, k in objects])
    offs = np.asarray([o for o, _, _ in objects], dtype=np.int64) + header
    return CopyPlanner(pages).layer(plan, offs, load)


def finish_save(saves, q) -> list[int]:
    """Wait for one queued layer save (``DeviceSaves``); each object's folded word checksum."""
    return saves.finish_saves([q])[0].tolist()
