"""The host load path's layer copy (CPU): a layer's raw parts of a step's objects into the
KV cache in a constant number of array ops, whatever the number of objects.

The copy runs on a load thread next to the forward (async_loads.py). Each op releases the
GIL and holds it again on return, and every time the load thread holds it the forward's
thread may wait for it (up to the 5 ms switch interval): a Python loop over objects per
layer would make the forward wait hundreds of times per hit (benchmarks/host_load_contention.py
times the GIL's share apart from the memory traffic's). So
per layer: one gather of every payload page (including pages read only for the checksum),
two sums over it, one numpy pass that combines them into each object's word checksum
(checksum.py), one scatter of the checked pages. A corrupt object still fails alone: its
pages are left out of the scatter and its entries are reported.

Only raw parts whose offsets and pages are whole 8-byte words take this path; int8 and
zstd parts decode per object (``decode_layer``: their decoders are per-object tensor code,
and the accelerator path covers int8 in bulk). Parts sealed with a CRC32 (by writers
before host writers sealed word sums, or zstd) are checked one by one: rare, and CRC32
has no batched form here.

A load the forward gave up on (``load_timeout_s``) must not write a page once the step
has reported its blocks failed: vLLM may recompute into them, or give them to another
request, at once. Every write goes through the job's ``WriteGate``.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from ascend_store.common.checksum import combine_sums
from ascend_store.common.codecs import scatter_pages
from ascend_store.common.transfer import (
    FLAG_CRC,
    FLAG_WSUM,
    HEADER_BYTES,
    CorruptObject,
    LayerLayout,
    _payload_sum,
    decode_object,
)
from ascend_store.device.segments import WORD, StepPages

# Pages gathered, checked and scattered at once. Small enough that a paced load
# (``Scratch.rest``) spreads its memory traffic over the forward's steps instead of
# landing a whole layer's in one of them; each batch costs a few GIL handoffs, which
# measured negligible next to the memory traffic (benchmarks/host_load_contention.py).
BATCH_BYTES = 4 << 20


@dataclass
class LayerFaults:
    """Entries (positions in the group's admitted entries) whose part of a layer failed."""

    entries: np.ndarray
    why: list[str]


class GivenUp(Exception):
    """The step gave the load up: its thread writes no more pages."""


class WriteGate:
    """A load thread's writes into the KV cache, against the step giving the load up.

    Each write (one batch's scatter, one int8 or zstd object's decode) runs inside ``with
    gate:``, under the lock and only while the load is live. Giving up only sets
    ``given_up``, so the forward's thread never waits for the load thread there; ``fence``,
    before the step reports the load's blocks, returns once the write under way (at most
    one batch, ``BATCH_BYTES``) is done, and none starts after it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.given_up = False

    def __enter__(self) -> None:
        self._lock.acquire()
        if self.given_up:
            self._lock.release()
            raise GivenUp

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def fence(self) -> None:
        with self._lock:
            pass


def words_of(arena: torch.Tensor) -> torch.Tensor | None:
    """The arena as int64 words (None when its start is not word aligned)."""
    if arena.storage_offset() % WORD:
        return None
    return arena[:arena.numel() // WORD * WORD].view(torch.int64)


def batched(layout: LayerLayout, codec, part_offsets: np.ndarray) -> bool:
    """Whether a layer's parts can take the batched copy."""
    return (codec.name == "raw" and layout.page_bytes % WORD == 0
            and not ((part_offsets + HEADER_BYTES) % WORD).any())


class Scratch:
    """The load thread's gather buffer, reused from batch to batch and layer to layer (a
    fresh buffer per layer is a fresh mapping, whose pages the kernel zeroes: one more
    pass over memory the forward shares), and its pace: after each batch it sleeps so
    that it copies ``share`` of the time (``async_load_share``)."""

    def __init__(self, share: float = 1.0):
        self.buf = torch.empty(0, dtype=torch.int64)
        self.share = share

    def rows(self, n: int, pw: int) -> torch.Tensor:
        if self.buf.numel() < n * pw:
            self.buf = torch.empty(n * pw, dtype=torch.int64)
        return self.buf[:n * pw].view(n, pw)

    def rest(self, since: float) -> None:
        """Sleep after work that started at ``since`` (perf_counter), if pacing."""
        if self.share < 1:
            time.sleep((time.perf_counter() - since) * (1 / self.share - 1))


def load_layer(words: torch.Tensor, arena: np.ndarray, layout: LayerLayout, pages: StepPages,
               starts: np.ndarray, headers: np.ndarray, live: np.ndarray, verify: bool,
               scratch: Scratch, gate: WriteGate) -> LayerFaults:
    """Copy one layer's parts into ``layout``'s cache. ``starts``: per entry, its part's
    arena offset (header included); ``headers``: per entry, that part's header; ``live``:
    the entries still to load. Pages of entries that fail their checksum are not written;
    no page is once ``gate`` is given up (``GivenUp`` is raised instead).
    The pages go in batches of whole entries of up to about BATCH_BYTES (one per layer
    unless the layer's hit is larger)."""
    pw = layout.page_bytes // WORD
    bad = np.zeros(len(starts), dtype=bool)
    why: dict[int, str] = {}
    flags = headers["flags"].astype(np.int64)
    wsum = live & ((flags & FLAG_WSUM) != 0) if verify else np.zeros(len(starts), dtype=bool)
    if verify:
        for e in np.flatnonzero(live & ((flags & (FLAG_WSUM | FLAG_CRC)) == 0)).tolist():
            bad[e], why[e] = True, "written without a checksum"
        for e in np.flatnonzero(live & ~wsum & ((flags & FLAG_CRC) != 0)).tolist():
            at = int(starts[e]) + HEADER_BYTES
            if zlib.crc32(arena[at:at + int(headers["payload"][e])]) != int(headers["crc"][e]):
                bad[e], why[e] = True, "checksum mismatch"
    take = (live & ~bad)[pages.obj]  # pages of live entries, entry after entry
    obj, page, block = pages.obj[take], pages.page[take], pages.block[take]
    src = torch.from_numpy((starts + HEADER_BYTES)[obj] // WORD + page * pw)
    view = words.unfold(0, pw, 1)  # every word offset's page-long run
    first = np.flatnonzero(np.r_[True, obj[1:] != obj[:-1]])  # each entry's first page
    per = max(1, BATCH_BYTES // layout.page_bytes)
    cuts = np.unique(np.r_[first[np.searchsorted(first, np.arange(per, len(obj), per), side="right") - 1],
                           len(obj)])
    at = 0
    for end in cuts.tolist():  # a few batches per layer, whatever the number of objects
        if end <= at:
            continue
        t0 = time.perf_counter()
        rows = scratch.rows(end - at, pw)
        torch.index_select(view, 0, src[at:end], out=rows)
        if verify:
            _check_words(rows, obj[at:end], page[at:end], pw, headers, wsum, bad, why)
        moved = (block[at:end] >= 0) & ~bad[obj[at:end]]
        if moved.all():
            with gate:
                scatter_pages(layout, _as_pages(rows, layout), block[at:end])
        elif moved.any():
            keep = torch.from_numpy(np.flatnonzero(moved))
            rows = rows.index_select(0, keep)
            with gate:
                scatter_pages(layout, _as_pages(rows, layout), block[at:end][moved])
        at = end
        scratch.rest(t0)
    failed = np.flatnonzero(bad)
    return LayerFaults(failed, [why[e] for e in failed.tolist()])


def copy_layer(words: torch.Tensor, arena: np.ndarray, layout: LayerLayout, adm, i: int, name: str,
               starts: np.ndarray, failed: set[int], verify: bool, scratch: Scratch,
               gate: WriteGate) -> list[tuple[int, str]]:
    """Layer ``i`` (``name``) of a group's admitted entries (``admission.Admitted``) by
    ``load_layer``; returns (load index, why) for each entry whose part failed."""
    live = ~np.isin(adm.entries, np.fromiter(failed, dtype=np.int64, count=len(failed)))
    faults = load_layer(words, arena, layout, adm.planner.pages, starts, adm.headers[i, adm.obj], live,
                        verify, scratch, gate)
    return [(int(adm.entries[e]), f"{adm.step.keys[adm.obj[e]]} layer {name}: {why}")
            for e, why in zip(faults.entries.tolist(), faults.why)]


def decode_layer(arena: torch.Tensor, layout: LayerLayout, codec, adm, i: int, name: str, loads: list,
                 failed: set[int], verify: bool, gate: WriteGate) -> list[tuple[int, str]]:
    """Object by object: int8 and zstd parts (per-object decoders) and unaligned raw ones.
    Returns (load index, why) for each entry whose part failed."""
    host = arena.numpy()
    checked: dict[int, bool] = {}
    bad = []
    for j, k in zip(adm.entries.tolist(), adm.obj.tolist()):
        if j in failed:
            continue
        off, h = int(adm.parts[i, k]), adm.headers[i, k]
        n = int(h["payload"])
        label = f"{adm.step.keys[k]} layer {name}"
        try:
            if verify and k not in checked:
                flags = int(h["flags"])
                checked[k] = bool(flags & (FLAG_CRC | FLAG_WSUM)) and \
                    _payload_sum(host[off + HEADER_BYTES:off + HEADER_BYTES + n], flags) == int(h["crc"])
            if verify and not checked[k]:
                raise CorruptObject(f"{label}: checksum mismatch")
            ld = loads[j]
            with gate:
                decode_object(arena[off:off + HEADER_BYTES + n], n, layout, ld.block_ids, ld.skip, label,
                              ld.object_blocks, codec)
        except CorruptObject as exc:
            bad.append((j, str(exc)))
    return bad


def _check_words(rows: torch.Tensor, obj: np.ndarray, page: np.ndarray, pw: int, headers: np.ndarray,
                 wsum: np.ndarray, bad: np.ndarray, why: dict[int, str]) -> None:
    """Each entry's word checksum from its pages' sums (``checksum.combine_sums``), against
    its header's."""
    weights = torch.arange(1, pw + 1, dtype=torch.int64)
    s1 = rows.sum(1).numpy().view(np.uint64)  # int64 sums wrap like the uint64 ones
    t = torch.mv(rows, weights).numpy().view(np.uint64)  # no [pages, words] temporary (3x faster here)
    first = np.flatnonzero(np.r_[True, obj[1:] != obj[:-1]])  # each entry's first page
    sums = combine_sums(s1, t, page * pw, first)
    entries = obj[first]
    wrong = wsum[entries] & (sums != headers["crc"][entries].astype(np.int64))
    for e in entries[wrong].tolist():
        bad[e], why[e] = True, "checksum mismatch"


def _as_pages(rows: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    return rows.view(torch.uint8).view(layout.tensor.dtype).view(len(rows), *layout.page_shape)
