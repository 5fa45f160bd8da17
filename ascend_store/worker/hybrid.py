"""Recurrent state of hybrid models (GDN / Mamba layers) in the pool.

In vLLM's ``align`` mode a linear-attention layer keeps, per block, the state after that
block's last token: a list of tensors (conv state, temporal state) that are strided
views over one raw page per block. A pool state object is one layer's used bytes of one
block's page, stored under the chunk's key like any KV object (docs/hybrid.md).

``DeferredStateCopies`` holds the runner's align-mode state copies of a step that loads:
vLLM queues them before ``start_load_kv``, so run as queued they would read state the
pool has not written yet. Each layer's copies run right after that layer's load landed.
"""

from __future__ import annotations

import torch

from ascend_store.common.transfer import LayerLayout, storage_view


def state_layout(tensors: list[torch.Tensor], num_blocks: int) -> LayerLayout:
    """``tensors``: the layer's state views (conv, temporal) as its kernels see them.
    Returns a [num_blocks, used bytes] uint8 view of a linear-attention layer's state pages,
    so the KV object code (transfer.py) moves one block's states as one page."""
    base = tensors[0].untyped_storage().data_ptr()
    page = None
    lo, hi = None, None
    for t in tensors:
        if t.untyped_storage().data_ptr() != base or t.shape[0] != num_blocks:
            raise ValueError("state tensors of one layer must be views over one buffer of "
                             f"{num_blocks} blocks, got {[(tuple(x.shape), x.data_ptr()) for x in tensors]}")
        stride = t.stride(0) * t.element_size()
        if page not in (None, stride) or not t[0].is_contiguous():
            raise ValueError(f"state tensor {tuple(t.shape)}/{t.stride()} is not one page per block")
        page = stride
        start = t.data_ptr() - base
        lo = start if lo is None else min(lo, start)
        hi = max(hi or 0, start + t[0].numel() * t.element_size())
    if hi - lo > page:
        raise ValueError(f"state of {hi - lo} bytes overlaps the next block's page ({page} bytes)")
    return LayerLayout(storage_view(tensors[0], torch.uint8, lo, (num_blocks, hi - lo), (page, 1)), 0)


class DeferredStateCopies:
    """Copies queued by the runner, matched to their layer by the address they write.

    vLLM places every layer in one backing buffer (layers interleave block by block), so
    a copy belongs to the state layer whose page region contains its destination."""

    def __init__(self, layouts: dict[str, LayerLayout]):
        self._layouts = layouts
        any_view = next(iter(layouts.values())).tensor
        self._base = any_view.untyped_storage().data_ptr()
        self._flat = storage_view(any_view, torch.uint8)
        self.pending: dict[str, list[tuple[int, int, int]]] = {}

    def _layer(self, ptr: int) -> str:
        for name, layout in self._layouts.items():
            t = layout.tensor
            off, page = ptr - t.data_ptr(), t.stride(0)
            if 0 <= off < t.shape[0] * page and off % page < t.shape[1]:
                return name
        raise ValueError(f"state copy address {ptr:#x} is in no registered state layer")

    def take(self, src, dst, sizes) -> None:
        for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
            layer = self._layer(d)
            if self._layer(s) != layer:
                raise ValueError(f"a state copy into {layer} reads another layer")
            self.pending.setdefault(layer, []).append((s - self._base, d - self._base, n))

    def run(self, layer: str) -> int:
        copies = self.pending.pop(layer, [])
        flat = self._flat
        for s, d, n in copies:
            flat[d:d + n].copy_(flat[s:s + n])
        return len(copies)

    def run_all(self) -> int:
        return sum(self.run(layer) for layer in list(self.pending))
