"""A KV layout self-test, run once when the worker registers vLLM's KV caches.

The worst silent failure a KV pool can have is wrong output after an engine upgrade
changed its cache layout: the copies go on moving bytes, to the wrong places. So before
the first request, one block of every registered layer part makes the round trip a hit
makes: the step's ``Saver`` writes it into a one-block chunk object, the step's
``Loader`` loads it into another block (the host copies or the batched device path,
the codec, the object format and its header checks, all as configured), and the block
must come back as it went (within the codec's error for int8), with the blocks around
it untouched. The blocks it used get their bytes back. Each KV cache group is probed on
its own: vLLM's hybrid models map one block id of every group to the same memory.

Where: the pool's memory, under a probe key of each object format that no chunk hash can
equal, reserved and never committed (aborted at the end), so no reader ever sees it.
When the pool cannot be reached at start (or has no room), the same round trip runs
through private host memory: only the memory differs, so a layout the copies get wrong
is still found before the pool comes up.

A block that comes back different turns the pool off for this worker (``PoolOff``):
every load fails, so vLLM recomputes, nothing is saved, and one error names the layer
part and its layout.
"""

from __future__ import annotations

import copy
import logging
import mmap
import os
import secrets
import time
from dataclasses import replace

import numpy as np
import torch

from ascend_store.backends import Backend, BackendUnavailable, Status
from ascend_store.backends.base import Slot, Slots
from ascend_store.common.metadata import ChunkLoad, ChunkSave
from ascend_store.common.transfer import LayerLayout
from ascend_store.ops.stats import IntervalCounters
from ascend_store.worker.loads import Loader
from ascend_store.worker.saves import Saver
from ascend_store.worker.worker_context import WorkerContext

log = logging.getLogger("ascend_store")

# The probe's blocks: saved from, loaded into, and the one after (0 is vLLM's null block).
SRC, DST, AFTER = 1, 2, 3
LOSSY_TOL = 0.02  # a lossy codec's allowed error, as a share of the page's largest value (int8: <= 0.5%)


class PoolOff:
    """The pool as the worker sees it after a failed self-test: every call fails as an
    unreachable pool's does, so every load fails (vLLM recomputes its blocks) and no save
    publishes anything."""

    def __init__(self, why: str):
        self.why = why

    def _off(self, *args, **kwargs):
        raise BackendUnavailable(self.why)

    buffer = lease_slots = reserve_slots = commit = abort = release = remove = _off


class ProbePool:
    """The pool as the probe's save and load see it: the probe objects' slots are
    reserved up front, the save's commit publishes nothing, the load's lease is answered
    from the reservations, and there is nothing to release or remove."""

    def __init__(self, epoch: str, view: memoryview, slots: dict[str, Slot]):
        self.epoch, self.view, self.slots = epoch, view, slots

    def buffer(self) -> tuple[str, memoryview]:
        return self.epoch, self.view

    def lease_slots(self, keys: list[str], sizes=None) -> Slots:
        return Slots.of([self.slots.get(k, Slot(Status.MISSING)) for k in keys])

    reserve_slots = lease_slots

    def commit(self, keys: list[str]) -> list[Status]:
        return [Status.OK if k in self.slots else Status.MISSING for k in keys]

    def abort(self, keys: list[str]) -> None:
        pass

    release = abort

    def remove(self, keys: list[str]) -> list[Status]:
        return [Status.OK] * len(keys)


def checked_pool(ctx: WorkerContext, num_blocks: int) -> Backend | PoolOff:
    """Round-trip a block of every layer part of ``ctx``; returns the backend the worker
    should use: ``ctx.backend``, or a ``PoolOff`` when a block came back wrong."""
    if num_blocks <= AFTER:
        log.info("ascend-store: %d KV cache blocks: too few for the layout self-test", num_blocks)
        return ctx.backend
    t0 = time.perf_counter()
    chunk = f"selftest-{os.getpid()}-{secrets.token_hex(4)}"  # chunk hashes are hex: names no chunk
    keys = {f.group: f.prefix + chunk for f in ctx.groups.values()}
    sizes = {f.group: int(f.size(np.ones(1, dtype=np.int64))[0]) for f in ctx.groups.values()}
    pool, in_pool = _reserve(ctx, keys, sizes)
    dp = ctx.device_path
    if dp is not None and not in_pool:  # private memory pinned apart: the pool's stays pinned
        dp = copy.copy(dp)
        dp._arena = None
    probe = replace(ctx, backend=pool, counters=IntervalCounters(), writer=(0, 1), device_path=dp,
                    _arena=None)
    saved = {n: [ctx.layouts[n].page(b).clone() for b in (SRC, DST, AFTER)] for n in ctx.order}
    try:
        failure = _probe(probe, chunk)
    except Exception as exc:  # the probe's own trouble is no proof the layout is right
        log.exception("ascend-store: the KV layout self-test failed to run")
        failure = f"the round trip raised {exc!r}"
    finally:
        for name, pages in saved.items():
            for b, page in zip((SRC, DST, AFTER), pages):
                ctx.layouts[name].page(b).copy_(page)
        if dp is not ctx.device_path:
            dp.close()
        if in_pool:
            try:
                ctx.backend.abort(list(keys.values()))
            except BackendUnavailable:
                pass  # the pool drops a reservation at its deadline
    seconds = time.perf_counter() - t0
    ctx.counters["selftest_layers"] += len(ctx.order)
    ctx.counters["selftest_seconds"] += seconds
    if failure:
        ctx.counters["selftest_failed"] += 1
        log.error("ascend-store: KV layout self-test failed: %s. The pool is off for this worker: every "
                  "request recomputes (docs/architecture.md, KV layout self-test)", failure)
        return PoolOff(f"the KV layout self-test failed: {failure}")
    log.info("ascend-store: KV layout self-test passed: %d layer parts (%d page layouts) round-tripped "
             "through %s in %.1f ms", len(ctx.order), len({ctx.layouts[n].describe() for n in ctx.order}),
             "the pool" if in_pool else "private memory", seconds * 1e3)
    return ctx.backend


def _reserve(ctx: WorkerContext, keys: dict[int, str], sizes: dict[int, int]) -> tuple[ProbePool, bool]:
    """Slots for the probe objects: in the pool's memory (reserved, never committed; True),
    or in private memory when the pool cannot be reached or has no room (False)."""
    names = list(keys.values())
    try:
        epoch, view = ctx.backend.buffer()
        got = ctx.backend.reserve_slots(names, np.asarray(list(sizes.values()), dtype=np.int64))
        slots = got.to_list()
        if all(s.status is Status.OK for s in slots):
            return ProbePool(epoch, view, dict(zip(names, slots))), True
        ctx.backend.abort([k for k, s in zip(names, slots) if s.status is Status.OK])
    except BackendUnavailable:
        pass
    offsets = np.concatenate([[0], np.cumsum([-(-n // 8) * 8 for n in sizes.values()])])
    memory = mmap.mmap(-1, int(offsets[-1]))  # page aligned, as pinning wants
    slots = {k: Slot(Status.OK, int(o), n) for k, o, n in zip(names, offsets.tolist(), sizes.values())}
    return ProbePool(f"selftest-{secrets.token_hex(4)}", memoryview(memory), slots), False


def _probe(probe: WorkerContext, chunk: str) -> str | None:
    """Each KV cache group's round trip, with the step's own save and load code; the first
    thing that went wrong, or None."""
    saver, loader = Saver(probe, defer_drain=False), Loader(probe)
    try:
        for source in sorted({f.source for f in probe.groups.values()}):
            failure = _round_trip(probe, saver, loader, source, chunk)
            if failure:
                return failure
        return None
    finally:
        saver.shutdown()
        loader.shutdown()


def _round_trip(probe: WorkerContext, saver: Saver, loader: Loader, source: int, chunk: str) -> str | None:
    """One block of every layer part of KV cache group ``source`` through a save and a
    load; what went wrong, or None."""
    names = [n for n in probe.order if probe.groups[probe.group_of[n][0]].source == source]
    gen = torch.Generator().manual_seed(source)
    for n in names:
        for b in (SRC, DST, AFTER):
            page = probe.layouts[n].page(b)
            page.copy_(_pattern(page, gen).to(page.device))
    before = {n: (probe.layouts[n].page(SRC).cpu(), probe.layouts[n].page(AFTER).cpu()) for n in names}
    saves = [ChunkSave("selftest", source, chunk, [SRC])]
    for n in names:
        saver.save_layer(n, saves)
    saver.end_step(saves, whole=False, publish=True)
    job = loader.start([ChunkLoad("selftest", source, chunk, [DST])], new_tokens=1)
    loader.finish(job, before_forward=True)
    if loader.errors():
        return f"the probe object of KV cache group {source} was rejected on load (see the warning above)"
    for n in names:
        layout, codec = probe.layouts[n], probe.codecs[n]
        src, dst, after = (probe.layouts[n].page(b).cpu() for b in (SRC, DST, AFTER))
        wrong = ("the block came back different" if not _same(dst, before[n][0], codec.lossy)
                 else "the load wrote outside its block" if not (_same(src, before[n][0], False)
                                                                 and _same(after, before[n][1], False))
                 else None)
        if wrong:
            return f"layer {n} ({_describe(layout)}, codec {codec.name}): {wrong}"
    return None


def _pattern(page: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random values of the page's dtype and shape (finite floats: a lossy codec reads them)."""
    if page.dtype.is_floating_point:
        return torch.randn(page.shape, generator=gen).to(page.dtype)
    info = torch.iinfo(page.dtype)
    return torch.randint(info.min, info.max + 1, page.shape, generator=gen, dtype=torch.int64).to(page.dtype)


def _same(got: torch.Tensor, want: torch.Tensor, lossy: bool) -> bool:
    if not lossy:
        return torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    scale = float(want.float().abs().max())
    return float((got.float() - want.float()).abs().max()) <= LOSSY_TOL * scale


def _describe(layout: LayerLayout) -> str:
    """The layout as read from the cache: page dtype and shape, the cache's shape/strides,
    and which dim holds the blocks."""
    t = layout.tensor
    return f"{layout.describe()}, cache {tuple(t.shape)}/{t.stride()}, blocks at dim {layout.block_dim}"
