"""The worker's batched transfer path (device_path.py) end to end, on every device here.

On CPU (CI) it runs the torch implementation; on a CUDA machine the same test runs the
Triton kernel against an arena registered with cudaHostRegister, exactly as the worker
does (``python -m pytest tests/unit/test_device_path.py`` there).
"""

from __future__ import annotations

import mmap

import pytest
import torch

from ascend_store.codecs import get_codec
from ascend_store.device_path import DevicePath, LayerObjects
from ascend_store.transfer import HEADER_BYTES, LayerLayout, object_bytes, read_object, seal

NB, T, H, D = 12, 16, 2, 64
RAW = get_codec("raw")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _layers(device):
    torch.manual_seed(0)
    fa = torch.randn(2, NB, T, H, D, dtype=torch.bfloat16, device=device)  # K and V apart
    blk = torch.randn(NB, H, T, 2 * D, dtype=torch.bfloat16, device=device)  # block-major
    return {"a": LayerLayout(fa, 1), "b": LayerLayout(blk, 0)}


def _objects(layouts, blocks_per_obj=3):
    """Two objects per layer, back to back in the arena (512-byte aligned like the pool)."""
    size = object_bytes(layouts["a"], blocks_per_obj, RAW)
    slot = (size + 511) // 512 * 512
    out, off = {}, 0
    for name in layouts:
        offs = [off, off + slot]
        off += 2 * slot
        out[name] = LayerObjects(name, offs, [size, size], [[1, 4, 7], [9, 2, 0]], [0, 0],
                                 [f"k/{name}/0", f"k/{name}/1"])
    return out, off


@pytest.mark.parametrize("device", DEVICES)
def test_save_then_load_through_the_pinned_arena(device):
    layouts = _layers(device)
    objs, total = _objects(layouts)
    path = DevicePath(torch.device(device), layouts)
    mapping = mmap.mmap(-1, total)
    arena = path.arena(1, mapping)
    after = path.dev.record()  # the compute stream's point after the layer wrote its KV
    for name, o in objs.items():
        q = path.save_layer(arena, o, after)
        for key, off, size, wsum in zip(o.keys, o.offsets, o.sizes, path.finish_save(q)):
            seal(arena[off:off + size], size - HEADER_BYTES, layouts[name], key, RAW, True, wsum=wsum)

    # The host path reads (and checks) what the batched path wrote.
    for name, o in objs.items():
        cpu = LayerLayout(torch.zeros_like(layouts[name].tensor, device="cpu"), layouts[name].block_dim)
        for key, off, size, blocks in zip(o.keys, o.offsets, o.sizes, o.blocks):
            read_object(arena[off:off + size], cpu, blocks, 0, key, 3, True, RAW)
            for b in blocks:
                assert torch.equal(cpu.page(b), layouts[name].page(b).cpu())

    # And the batched path loads it into an empty cache of another engine.
    empty = {n: LayerLayout(torch.zeros_like(lay.tensor), lay.block_dim) for n, lay in layouts.items()}
    loader = DevicePath(torch.device(device), empty)
    arena2 = loader.arena(1, mapping)
    seen, bad = [], []

    def ready(name, event):
        seen.append(name)
        loader.dev.wait(event)  # the compute stream waits; the host does not

    loader.load_layers(arena2, list(objs.values()), True, ready, lambda name, i: bad.append((name, i)))
    assert seen == ["a", "b"] and bad == []
    for name, o in objs.items():
        for blocks in o.blocks:
            for b in blocks:
                assert torch.equal(empty[name].page(b), layouts[name].page(b))
    path.close()
    loader.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_flipped_byte_fails_only_its_object(device):
    layouts = _layers(device)
    objs, total = _objects(layouts)
    path = DevicePath(torch.device(device), layouts)
    arena = path.arena(1, mmap.mmap(-1, total))
    for name, o in objs.items():
        q = path.save_layer(arena, o, path.dev.record())
        for key, off, size, wsum in zip(o.keys, o.offsets, o.sizes, path.finish_save(q)):
            seal(arena[off:off + size], size - HEADER_BYTES, layouts[name], key, RAW, True, wsum=wsum)
    o = objs["b"]
    arena[o.offsets[1] + HEADER_BYTES + 1000] ^= 0x04
    results = []
    path.load_layers(arena, list(objs.values()), True, lambda n, ev: None,
                     lambda n, bad: results.append((n, bad)))
    if path.dev.is_accelerator:
        torch.cuda.synchronize()
    assert results == [("b", [1])]
    path.close()


def test_adjacent_slots_are_read_in_one_run():
    from ascend_store.device_path import _spans

    spans, staged = _spans([1024, 0, 9000, 520, 20000], [500, 500, 500, 500, 500])
    assert spans == [(0, 1524), (9000, 9500), (20000, 20500)]
    assert staged == [1024, 0, 1524, 520, 2024]
