"""The gate of a step's loads: one ``lease`` of the step's chunk objects, then every layer
part's header checked in one numpy pass (key, layer, layout, codec, size), on the host
and accelerator paths alike (loads.py). Missing objects fail their load; a corrupt one,
or a load vLLM gave no block to, is rejected: its chunk is recomputed and, once the lease
is released, its object removed from the pool. ``job`` is a ``loads.LoadJob``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from ascend_store.backends import Status
from ascend_store.common.transfer import (
    FLAG_LOSSY,
    HEADER_RECORD,
    CorruptObject,
    check_headers,
    fault_messages,
    walk_parts,
)
from ascend_store.device.segments import CopyPlanner, StepPages
from ascend_store.worker.worker_context import GroupStep, WorkerContext

log = logging.getLogger("ascend_store")


@dataclass
class Admitted:
    """A group's entries that passed the header gate, and their objects' layer parts."""

    step: GroupStep
    entries: np.ndarray  # indexes into the job's loads
    obj: np.ndarray  # per entry: index into step.keys
    parts: np.ndarray  # [layer, object] arena offset of each part
    sizes: np.ndarray  # [layer, object] part sizes
    headers: np.ndarray  # [layer, object] HEADER_RECORD
    planner: CopyPlanner  # the entries' pages, shared by the group's layers


def lease(ctx: WorkerContext, job) -> tuple[torch.Tensor, list[Admitted]]:
    """Lease the step's chunk objects (one call) and check every layer part's header
    at once (and payload sums the device copy will not compute)."""
    ctx.arena()  # map the arena first so slot bounds are checked against it
    steps = ctx.plan(job.loads)
    keys = [k for st in steps for k in st.keys]
    sizes = np.concatenate([st.fmt.size(st.blocks) for st in steps]) if steps else np.zeros(0, np.int64)
    slots = ctx.backend.lease_slots(keys, sizes.tolist())
    status, offs, got = slots
    job.leased = [k for k, ok in zip(keys, (status == Status.OK).tolist()) if ok]
    arena = ctx.arena()  # again: a pool restart seen by the lease remaps it
    out, at = [], 0
    for st in steps:
        n = len(st.keys)
        out.append(_admit(ctx, job, arena, st, status[at:at + n], offs[at:at + n], got[at:at + n]))
        at += n
    return arena, out


def _admit(ctx: WorkerContext, job, arena: torch.Tensor, st: GroupStep, status: np.ndarray,
           offs: np.ndarray, sizes: np.ndarray) -> Admitted:
    """The gate loaded objects pass on either path: count missing objects, refuse
    vLLM's null block, check every layer part's header in one numpy pass."""
    fmt = st.fmt
    host = arena.numpy()
    missing = status != Status.OK
    ctx.counters["load_missing"] += int(missing.sum())
    keep = ~missing[st.obj]
    for j in st.entries[missing[st.obj]].tolist():
        job.failed.add(j)
    for j in st.entries[keep].tolist():
        if j in job.unplaced:  # vLLM's null block: nowhere to load to
            reject(ctx, job, j, CorruptObject(f"{job.loads[j].chunk_hash}: no block allocated for it"))
    used = np.zeros(len(st.keys), dtype=bool)
    used[st.obj[keep]] = True
    used = np.flatnonzero(used)
    if fmt.fixed:
        parts, part_sizes = fmt.parts(offs, st.blocks), fmt.part_sizes(st.blocks)
        whole = sizes == fmt.size(st.blocks)
    else:
        parts, part_sizes = walk_parts(host, offs, sizes, len(fmt.layers))
        whole = np.ones(len(offs), dtype=bool)
    limit = fmt.per_block[:, None] * st.blocks[None, :]
    fps = fmt.fingerprints(st.keys)
    codes = np.zeros(parts.shape, dtype=np.int64)
    headers = np.zeros(parts.shape, dtype=HEADER_RECORD)
    if len(used):
        part_sizes = np.where(whole[None, :], part_sizes, 0)  # a wrong-sized object fits nowhere
        every = len(used) == len(st.keys)  # the common case: no column to pick or put back
        cols = slice(None) if every else used
        c, h = check_headers(host, parts[:, cols].reshape(-1), part_sizes[:, cols].reshape(-1),
                             fps[:, cols].reshape(-1), limit[:, cols].reshape(-1),
                             ctx.cfg.verify_checksum and ctx.device_path is not None,
                             ctx.codecs[fmt.layers[0]], wsum_later=True)
        c, h = c.reshape(len(fmt.layers), -1), h.reshape(len(fmt.layers), -1)
        if every:
            codes, headers = c, h
        else:
            codes[:, used], headers[:, used] = c, h
    bad_obj = codes.any(axis=0)
    for k in np.flatnonzero(bad_obj).tolist():
        i = int(np.flatnonzero(codes[:, k])[0])
        why = fault_messages(codes[i:i + 1, k], headers[i:i + 1, k], part_sizes[i:i + 1, k],
                             limit[i:i + 1, k], lambda _: f"{st.keys[k]} layer {fmt.layers[i]}")[0]
        for j in st.entries[st.obj == k].tolist():
            reject(ctx, job, j, CorruptObject(why))
    lossy = ((headers["flags"] & FLAG_LOSSY) != 0).any(axis=0) & ~bad_obj
    if lossy.any():
        _refuse_lossy(ctx, job, st, lossy)
    good = np.fromiter((j not in job.failed for j in st.entries.tolist()), dtype=bool,
                       count=len(st.entries))
    entries, obj = st.entries[good], st.obj[good]
    loads = [job.loads[j] for j in entries.tolist()]
    pages = StepPages.of([ld.block_ids for ld in loads], [ld.skip for ld in loads],
                         [ld.object_blocks for ld in loads])
    moved = int(sum(len(ld.block_ids) for ld in loads))
    ctx.counters["loaded_objects"] += len(used)
    ctx.counters["loaded_bytes"] += moved * int(fmt.per_block.sum())
    return Admitted(st, entries, obj, parts, part_sizes, headers, CopyPlanner(pages))


def _refuse_lossy(ctx: WorkerContext, job, st: GroupStep, lossy: np.ndarray) -> None:
    """Loads that asked for lossless KV fail where their object came back from a lossy tier
    form: their chunks are recomputed, and the object stays for readers that take it."""
    wants = np.fromiter((job.loads[j].lossless for j in st.entries.tolist()), dtype=bool,
                        count=len(st.entries))
    refused = st.entries[wants & lossy[st.obj]].tolist()
    if refused and not ctx.counters["load_lossy_refused"]:
        log.warning("KV pool objects from a lossy tier (INT8 on the disk tier) refused for requests "
                    "that ask for lossless KV; those chunks are recomputed")
    ctx.counters["load_lossy_refused"] += len(refused)
    job.failed.update(refused)


def reject(ctx: WorkerContext, job, j: int, exc: CorruptObject) -> None:
    """Load ``j`` fails: its object is corrupt (removed from the pool once released)."""
    ctx.counters["load_corrupt"] += 1
    log.warning("KV pool object rejected, recomputing: %s", exc)
    job.failed.add(j)
    job.corrupt.add(j)
