"""The worker's batched transfer path (device_path.py) end to end, on every device here.

On CPU (CI) it runs the torch implementation; on a CUDA machine the same test runs the
Triton kernel against an arena registered with cudaHostRegister, exactly as the worker
does (``python -m pytest tests/unit/test_device_path.py`` there).
"""

from __future__ import annotations

import mmap

import pytest
import torch

from ascend_store.common.codecs import get_codec
from ascend_store.common.transfer import (
    FLAG_WSUM,
    HEADER_BYTES,
    LayerLayout,
    object_bytes,
    seal,
)
from ascend_store.device.device_path import DevicePath
from ascend_store.device.device_work import LayerObjects
from tests.unit.objects import finish_save, header_faults, read_object

NB, T, H, D = 12, 16, 2, 64
RAW = get_codec("raw")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _layers(device):
    torch.manual_seed(0)
    fa = torch.randn(2, NB, T, H, D, dtype=torch.bfloat16, device=device)  # K and V apart
    blk = torch.randn(NB, H, T, 2 * D, dtype=torch.bfloat16, device=device)  # block-major
    return {"a": LayerLayout(fa, 1), "b": LayerLayout(blk, 0)}


def _load_all(path, arena, objs, layouts, ready=lambda name, event: None):
    """What the worker does: check the headers (taking each one's word checksum), queue
    every layer's copy, then check the sums; returns (layer, bad indexes) per layer."""
    queued = []
    for o in objs.values():
        faults, h = header_faults(arena.numpy(), o.offsets, o.sizes, o.keys, layouts[o.name], 3, True, RAW,
                                  wsum_later=True)
        assert faults == [None] * len(o.offsets)
        o.stored = [int(c) if f & FLAG_WSUM else -1 for c, f in zip(h["crc"], h["flags"])]
        q = path.queue_batch(arena, path.batches([o])[0])
        ready(o.name, q.done)
        queued.append(q)
    return [(q.layers[0].name, bad) for q, (bad,) in zip(queued, path.check_loads(queued, True))]


def _objects(layouts, blocks_per_obj=3, reverse=False):
    """Two objects per layer, back to back in the arena (512-byte aligned like the pool);
    ``reverse``: the second object's slot comes first (the pool hands out slots in any order)."""
    size = object_bytes(layouts["a"], blocks_per_obj, RAW)
    slot = (size + 511) // 512 * 512
    out, off = {}, 0
    for name in layouts:
        offs = [off + slot, off] if reverse else [off, off + slot]
        off += 2 * slot
        out[name] = LayerObjects(name, offs, [size, size], [[1, 4, 7], [9, 2, 0]], [0, 0],
                                 [f"k/{name}/0", f"k/{name}/1"])
    return out, off


@pytest.mark.parametrize("reverse", [False, True], ids=["slots-in-order", "slots-reversed"])
@pytest.mark.parametrize("device", DEVICES)
def test_save_then_load_through_the_pinned_arena(device, reverse):
    layouts = _layers(device)
    objs, total = _objects(layouts, reverse=reverse)
    path = DevicePath(torch.device(device), layouts)
    mapping = mmap.mmap(-1, total)
    arena = path.arena(1, mapping)
    after = path.dev.record()  # the compute stream's point after the layer wrote its KV
    for name, o in objs.items():
        q = path.save_layer(arena, o, after)
        for key, off, size, wsum in zip(o.keys, o.offsets, o.sizes, finish_save(path, q)):
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
    seen = []

    def ready(name, event):
        seen.append(name)
        loader.dev.wait(event)  # the compute stream waits; the host does not

    assert _load_all(loader, arena2, objs, empty, ready) == [("a", []), ("b", [])]
    assert seen == ["a", "b"]
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
        for key, off, size, wsum in zip(o.keys, o.offsets, o.sizes, finish_save(path, q)):
            seal(arena[off:off + size], size - HEADER_BYTES, layouts[name], key, RAW, True, wsum=wsum)
    o = objs["b"]
    arena[o.offsets[1] + HEADER_BYTES + 1000] ^= 0x04
    assert _load_all(path, arena, objs, layouts) == [("a", []), ("b", [1])]
    path.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_of_layers_loads_from_chunk_objects_with_one_plan(device):
    """Chunk objects hold their layers' parts back to back: a group's layers (separate
    cache tensors, one page shape) load as one batch, one span per object and one kernel,
    and a flipped byte fails its object in its layer only; a load that skips the first
    page of an object (the device held it) moves the rest."""
    import numpy as np

    from ascend_store.device.segments import CopyPlanner, StepPages

    torch.manual_seed(2)
    names = [f"L{i}" for i in range(4)]
    layouts = {n: LayerLayout(torch.randn(2, NB, T, H, D, dtype=torch.bfloat16, device=device), 1)
               for n in names}
    part = object_bytes(layouts["L0"], 3, RAW)
    stride = (part * len(names) + 511) // 512 * 512  # a chunk object: every layer's part
    blocks = [[1, 4, 7], [9, 2, 0], [3, 5, 6]]
    planner = CopyPlanner(StepPages.of(blocks, [0, 0, 0]))
    objs = [LayerObjects(n, [c * stride + i * part for c in range(3)], [part] * 3, blocks, [0, 0, 0],
                         [f"k/{c}" for c in range(3)], planner=planner) for i, n in enumerate(names)]
    path = DevicePath(torch.device(device), layouts)
    arena = path.arena(1, mmap.mmap(-1, 3 * stride))
    for o in objs:
        for key, off, wsum in zip(o.keys, o.offsets, finish_save(path, path.save_layer(arena, o, None))):
            seal(arena[off:off + part], part - HEADER_BYTES, layouts[o.name], key, RAW, True, wsum=wsum)
            o.stored = None
    sealed = arena.numpy().copy()

    empty = {n: LayerLayout(torch.zeros_like(lay.tensor), 1) for n, lay in layouts.items()}
    loader = DevicePath(torch.device(device), empty)
    arena2 = loader.arena(1, mmap.mmap(-1, 3 * stride))
    arena2.numpy()[:] = sealed
    arena2[objs[2].offsets[1] + HEADER_BYTES + 300] ^= 0x01  # layer L2's part of object 1
    for o in objs:
        faults, h = header_faults(arena2.numpy(), o.offsets, o.sizes, o.keys, empty[o.name], 3, True, RAW,
                                  wsum_later=True)
        assert faults == [None] * 3
        o.stored = np.where(h["flags"] & FLAG_WSUM, h["crc"].astype(np.int64), -1)
    batches = loader.batches(objs)
    assert [[o.name for o in b.layers] for b in batches] == [names]
    q = loader.queue_batch(arena2, batches[0])
    assert loader.check_loads([q], True) == [[[], [], [1], []]]
    for o in objs:
        for c, bl in enumerate(blocks):
            for b in bl:
                if b and not (o.name == "L2" and c == 1):
                    assert torch.equal(empty[o.name].page(b), layouts[o.name].page(b))

    # The first page of object 0 is already on the device: only pages 1.. move, to new blocks.
    skipped = CopyPlanner(StepPages.of([[10, 11]], [1]))
    part_load = [LayerObjects(o.name, o.offsets[:1], o.sizes[:1], [[10, 11]], [1], o.keys[:1], o.stored[:1],
                              planner=skipped) for o in objs]
    q = loader.queue_batch(arena2, loader.batches(part_load)[0])
    assert loader.check_loads([q], True) == [[[], [], [], []]]
    for o in objs:
        for src, dst in ((4, 10), (7, 11)):
            assert torch.equal(empty[o.name].page(dst), layouts[o.name].page(src))
    path.close()
    loader.close()


@pytest.mark.parametrize("device", DEVICES)
def test_first_batches_staged_while_the_rest_is_planned_land_in_order(device, monkeypatch):
    """``batches(..., arena)`` queues the first batches' DMAs (one per staging buffer)
    before planning the rest; a layer a batch (so the two buffers are reused by later
    batches) still lands every page, and a flipped byte still fails its object only.
    On CPU nothing is staged (the copy reads the arena)."""
    import numpy as np

    from ascend_store.device import device_path
    from ascend_store.device.segments import CopyPlanner, StepPages

    monkeypatch.setattr(device_path, "BATCH_BYTES", 1)  # every layer a batch of its own
    torch.manual_seed(3)
    names = [f"L{i}" for i in range(5)]
    layouts = {n: LayerLayout(torch.randn(2, NB, T, H, D, dtype=torch.bfloat16, device=device), 1)
               for n in names}
    part = object_bytes(layouts["L0"], 3, RAW)
    stride = (part * len(names) + 511) // 512 * 512
    blocks = [[1, 4, 7], [9, 2, 3]]
    planner = CopyPlanner(StepPages.of(blocks, [0, 0]))
    objs = [LayerObjects(n, [c * stride + i * part for c in range(2)], [part] * 2, blocks, [0, 0],
                         [f"k/{c}" for c in range(2)], planner=planner) for i, n in enumerate(names)]
    path = DevicePath(torch.device(device), layouts)
    arena = path.arena(1, mmap.mmap(-1, 2 * stride))
    for o in objs:
        for key, off, wsum in zip(o.keys, o.offsets, finish_save(path, path.save_layer(arena, o, None))):
            seal(arena[off:off + part], part - HEADER_BYTES, layouts[o.name], key, RAW, True, wsum=wsum)
    arena[objs[3].offsets[0] + HEADER_BYTES + 64] ^= 0x01  # layer L3's part of object 0

    empty = {n: LayerLayout(torch.zeros_like(lay.tensor), 1) for n, lay in layouts.items()}
    loader = DevicePath(torch.device(device), empty)
    for o in objs:
        _, h = header_faults(arena.numpy(), o.offsets, o.sizes, o.keys, empty[o.name], 3, True, RAW,
                             wsum_later=True)
        o.stored = np.where(h["flags"] & FLAG_WSUM, h["crc"].astype(np.int64), -1)
    batches = loader.batches(objs, arena)
    staged = [b.staging is not None for b in batches]
    assert staged == ([True, True, False, False, False] if device != "cpu" else [False] * 5)
    queued = [loader.queue_batch(arena, b) for b in batches]
    assert loader.check_loads(queued, True) == [[[]], [[]], [[]], [[0]], [[]]]
    for o in objs:
        for c, bl in enumerate(blocks):
            if not (o.name == "L3" and c == 0):
                for b in bl:
                    assert torch.equal(empty[o.name].page(b), layouts[o.name].page(b))
    path.close()
    loader.close()


def test_equally_spaced_parts_move_as_one_2d_copy_each_run():
    """A layer's parts of chunk objects saved side by side are one 2D DMA; a size or a
    distance that changes starts another run, and every run has one pitch."""
    import numpy as np

    from ascend_store.device.segments import dma_runs

    offs = np.array([1000, 5000, 9000, 13000, 20000, 20512, 21024, 30000], dtype=np.int64)
    sizes = np.array([512] * 7 + [256], dtype=np.int64)
    assert dma_runs(offs, sizes) == [(0, 4, 4000), (4, 3, 512), (7, 1, 256)]
    assert dma_runs(offs[:1], sizes[:1]) == [(0, 1, 512)]
    overlapping = np.array([0, 100], dtype=np.int64), np.array([512, 512], dtype=np.int64)
    assert dma_runs(*overlapping) == [(0, 1, 512), (1, 1, 512)]


def _save_sealed(path, arena, objs: dict, layouts: dict, size: int, codec) -> None:
    """Save each layer's objects through ``path`` and seal them, as the worker's saves do."""
    for name, o in objs.items():
        q = path.save_layer(arena, o, path.dev.record())
        for key, off, wsum in zip(o.keys, o.offsets, finish_save(path, q)):
            seal(arena[off:off + size], size - HEADER_BYTES, layouts[name], key, codec, True, wsum=wsum)


def _stored_sums(arena, o, layout, codec) -> list[int]:
    """The word sums the headers of a layer's two 3-block objects hold (checked whole)."""
    faults, h = header_faults(arena.numpy(), o.offsets, o.sizes, o.keys, layout, 3, True, codec,
                              wsum_later=True)
    assert faults == [None, None]
    return h["crc"].astype("int64").tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_int8_layers_match_the_host_codec_both_ways(device):
    """int8 layers are (de)quantized by whole-layer tensor ops on the device: what they
    write, the host codec reads, and what the host codec wrote, they load identically;
    a flipped payload byte still fails its object."""
    int8 = get_codec("int8")
    torch.manual_seed(1)
    fa = torch.randn(2, NB, T, H, D, dtype=torch.bfloat16, device=device)
    cpu_style = torch.randn(NB, H, T, 2 * D, dtype=torch.bfloat16, device=device)
    layouts = {"a": LayerLayout(fa, 1, (H, T, D)), "b": LayerLayout(cpu_style, 0, (H, T, D))}
    size = object_bytes(layouts["a"], 3, int8)
    slot = (size + 511) // 512 * 512
    objs = {name: LayerObjects(name, [2 * i * slot, (2 * i + 1) * slot], [size, size], [[1, 4, 7], [9, 2, 5]],
                               [0, 0], [f"k/{name}/0", f"k/{name}/1"]) for i, name in enumerate(layouts)}
    path = DevicePath(torch.device(device), layouts, {n: int8 for n in layouts})
    arena = path.arena(1, mmap.mmap(-1, 4 * slot))
    _save_sealed(path, arena, objs, layouts, size, int8)

    host = {n: LayerLayout(lay.tensor.cpu(), lay.block_dim, lay.kv_dims) for n, lay in layouts.items()}
    for name, o in objs.items():
        dst = LayerLayout(torch.zeros_like(host[name].tensor), host[name].block_dim, host[name].kv_dims)
        for key, off, blocks in zip(o.keys, o.offsets, o.blocks):
            read_object(arena[off:off + size], dst, blocks, 0, key, 3, True, int8)  # checks the word sums
            ref = torch.empty(size - HEADER_BYTES, dtype=torch.uint8)
            int8.encode_into(host[name], blocks, ref)  # the host codec on the same pages
            if device == "cpu":  # same ops on the same device: the same bytes
                assert torch.equal(arena[off + HEADER_BYTES:off + size], ref)
            for b in blocks:
                want = host[name].page(b).float()
                assert (dst.page(b).float() - want).norm() / want.norm() < 0.01

    empty = {n: LayerLayout(torch.zeros_like(lay.tensor), lay.block_dim, lay.kv_dims)
             for n, lay in layouts.items()}
    loader = DevicePath(torch.device(device), empty, {n: int8 for n in empty})
    queued = []
    for name, o in objs.items():
        o.stored = _stored_sums(arena, o, empty[name], int8)
        queued.append(loader.queue_batch(arena, loader.batches([o])[0]))
    assert loader.check_loads(queued, True) == [[[]], [[]]]
    for name, o in objs.items():
        dst = LayerLayout(torch.zeros_like(host[name].tensor), host[name].block_dim, host[name].kv_dims)
        for key, off, blocks in zip(o.keys, o.offsets, o.blocks):
            read_object(arena[off:off + size], dst, blocks, 0, key, 3, True, int8)
            for b in blocks:
                assert torch.equal(empty[name].page(b).cpu(), dst.page(b))

    # A partial load (the device cache held the chunk's first page): pages 1.. only.
    o = objs["a"]
    part = LayerObjects("a", o.offsets[:1], o.sizes[:1], [[10, 11]], [1], o.keys[:1], o.stored[:1])
    assert loader.check_loads([loader.queue_batch(arena, loader.batches([part])[0])], True) == [[[]]]
    for src, dst in ((4, 10), (7, 11)):
        assert torch.equal(empty["a"].page(dst), empty["a"].page(src))

    arena[objs["b"].offsets[0] + HEADER_BYTES + 77] ^= 0x10
    assert loader.check_loads([loader.queue_batch(arena, loader.batches([objs["b"]])[0])], True) == [[[0]]]
    path.close()
    loader.close()


@pytest.mark.parametrize("device", DEVICES)
def test_int8_layers_of_one_shape_load_in_one_batch(device):
    """Consecutive int8 layers of one shape share a batch (one kernel on CUDA), as raw
    layers do: each layer's pages land in its own cache as the host codec reads them, and a
    flipped byte fails its own [layer, object] only."""
    int8 = get_codec("int8")
    torch.manual_seed(2)
    names = ["l0", "l1", "l2"]
    src = {n: LayerLayout(torch.randn(2, NB, T, H, D, dtype=torch.bfloat16, device=device), 1, (H, T, D))
           for n in names}
    size = object_bytes(src["l0"], 3, int8)
    slot = (size + 511) // 512 * 512
    objs = {n: LayerObjects(n, [(2 * i) * slot, (2 * i + 1) * slot], [size, size], [[1, 4, 7], [9, 2, 5]],
                            [0, 0], [f"k/{n}/0", f"k/{n}/1"]) for i, n in enumerate(names)}
    path = DevicePath(torch.device(device), src, {n: int8 for n in names})
    arena = path.arena(1, mmap.mmap(-1, 2 * len(names) * slot))
    _save_sealed(path, arena, objs, src, size, int8)
    empty = {n: LayerLayout(torch.zeros_like(lay.tensor), lay.block_dim, lay.kv_dims)
             for n, lay in src.items()}
    loader = DevicePath(torch.device(device), empty, {n: int8 for n in names})
    step = [LayerObjects(n, o.offsets, o.sizes, [[3, 5, 6], [8, 10, 11]], [0, 0], o.keys,
                         _stored_sums(arena, o, empty[n], int8)) for n, o in objs.items()]
    plan = step[0].plan()
    for lo in step[1:]:
        lo.planner = plan  # one step: the layers share its page plan
    batches = loader.batches(step)
    assert [len(b.layers) for b in batches] == [3]
    assert loader.check_loads([loader.queue_batch(arena, batches[0])], True) == [[[], [], []]]
    for n, o in objs.items():
        want = LayerLayout(torch.zeros(2, NB, T, H, D, dtype=torch.bfloat16), 1, (H, T, D))
        for off, blocks in zip(o.offsets, ([3, 5, 6], [8, 10, 11])):
            read_object(arena[off:off + size], want, blocks, 0, o.keys[o.offsets.index(off)], 3, True, int8)
            for b in blocks:
                assert torch.equal(empty[n].page(b).cpu(), want.page(b)), (n, b)

    arena[objs["l1"].offsets[1] + HEADER_BYTES + 40] ^= 0x10
    again = loader.batches(step)
    assert loader.check_loads([loader.queue_batch(arena, again[0])], True) == [[[], [1], []]]
    path.close()
    loader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's compiled variants: CUDA only")
def test_steps_of_any_size_compile_no_kernel_after_warm_up():
    """Triton compiles a kernel once per alignment of its pointer arguments and per special
    value (1, multiples of 16) of its integer ones; a compile the machine has not cached
    took hundreds of ms on the step's thread in the H200 runs of 16 requests at once.
    After ``warm_up``, raw and int8 steps of 1, 2, 7 and 16 objects (odd and even segment
    counts) load and save correctly and compile nothing."""
    from ascend_store.device import kernels

    def variants():
        return sum(len(c[0]) for k in (kernels._load_rows_kernel, kernels._copy_segments_sum_kernel,
                                       kernels._int8_load_kernel) for c in k.device_caches.values())

    torch.manual_seed(3)
    int8 = get_codec("int8")
    for codec in (RAW, int8):
        layouts = {"a": LayerLayout(torch.randn(2, NB, T, H, D, dtype=torch.bfloat16, device="cuda"), 1,
                                    (H, T, D))}
        path = DevicePath(torch.device("cuda"), layouts, {"a": codec})
        path.warm_up()
        before = variants()
        for n, per in ((1, 1), (2, 3), (7, 1), (16, 1), (3, 2)):
            size = object_bytes(layouts["a"], per, codec)
            slot = (size + 511) // 512 * 512
            blocks = [[(i * per + j) % NB for j in range(per)] for i in range(n)]
            o = LayerObjects("a", [i * slot for i in range(n)], [size] * n, blocks, [0] * n,
                             [f"k/{i}" for i in range(n)])
            arena = path.arena(n, mmap.mmap(-1, n * slot))
            for key, off, wsum in zip(o.keys, o.offsets, finish_save(path, path.save_layer(arena, o, None))):
                seal(arena[off:off + size], size - HEADER_BYTES, layouts["a"], key, codec, True, wsum=wsum)
            faults, h = header_faults(arena.numpy(), o.offsets, o.sizes, o.keys, layouts["a"], per, True,
                                      codec, wsum_later=True)
            assert faults == [None] * n
            o.stored = h["crc"].astype("int64").tolist()
            assert path.check_loads([path.queue_batch(arena, path.batches([o])[0])], True) == [[[]]]
        assert variants() == before
        path.close()


def test_payload_layouts_are_kept_per_step_planner():
    """Batches of one ``batches`` call with planners of their own and the same staging
    layout each get that layout on the device, in their own planner (the memo a later
    batch of the step reads). The CUDA branch of the planning runs here with the device
    calls on the CPU: what it cannot show is the kernel reading the uploaded arrays (the
    CUDA tests above do, on a GPU)."""
    layouts = {n: LayerLayout(torch.randn(2, NB, T, H, D, dtype=torch.bfloat16), 1) for n in ("a", "b")}
    part = object_bytes(layouts["a"], 3, RAW)
    objs = [LayerObjects(n, [i * 4096 + c * 2048 for c in range(2)], [part] * 2, [[1, 4, 7], [9, 2, 3]],
                         [0, 0], ["k0", "k1"]) for i, n in enumerate(layouts)]  # a planner each
    path = DevicePath(torch.device("cpu"), layouts)
    planned = path.batches(objs)
    path.dev.type, path.dev._mod = "cuda", torch.cuda  # plan as on CUDA; tensors stay on the CPU
    path._plan_dmas(planned)
    path._plan_raw(planned)
    assert [len(o.plan().payloads) for o in objs] == [1, 1]
    kept = [next(iter(o.plan().payloads.values())) for o in objs]
    assert [b.obj_base.tolist() for b in planned] == [t.tolist() for t in kept]
