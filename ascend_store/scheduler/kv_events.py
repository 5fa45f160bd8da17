"""The pool's objects as vLLM KV events, in vLLM's own terms: ``BlockStored`` /
``BlockRemoved`` under vLLM's block hashes (``request.block_hashes``: the engine's
``prefix_caching_hash_algo`` and seed), with the parent block's hash, the token ids,
vLLM's ``block_size``, the LoRA adapter and extra keys, as vLLM's KV cache manager reports
the blocks it caches. So a router keyed on vLLM's block hashes matches them against its
prompts. vLLM publishes them on its ``kv_events_config`` publisher.

Only the scheduler knows what an object holds, when it plans the object's save
(``planned``: the request's tokens and hashes of the object's blocks). A map bounded by
``TRACKED_BYTES`` keeps that per object (KV cache group, chunk hash), and the tiers the
object was reported in, so each later store or removal of it becomes an event:
- the local pool: its event log (backends/local/events.py) tells when an object enters or
  leaves a tier (commit, spill, promotion, eviction, removal), read once per step;
- a store without a log (Mooncake, memcache): one ``exists`` per step for the planned
  objects (every shard and layer span) until they are there, for at most ``PENDING_S``;
  an object whose load failed (the worker's report) is asked again, and reported removed
  if it is gone. Their own evictions are not known to this engine.
The pool is asked on the lookup thread (lookups.py: ``fetch``); ``take``, which vLLM's
scheduler calls once per step, hands over what is ready: a slow pool delays events, never
the step. The objects another engine saved are that engine's to report.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.local.events import STORED

log = logging.getLogger("ascend_store")

MEDIA = ("CPU", "STORAGE")  # per pool tier (memory, disk): vLLM's MEDIUM_CPU and MEDIUM_STORAGE
TRACKED_BYTES = 32 << 20  # what the objects' vLLM terms may take; the least recently stored go
OBJECT_BYTES = 600  # an object's key, entry and headers besides its tokens and hashes (measured)
PENDING_S = 30.0  # a store without a log: a planned object not there by then is not reported


def enabled(vllm_config) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


@dataclass(slots=True)
class _Object:
    """One chunk object of one KV cache group, in vLLM's terms."""

    hashes: np.ndarray | list  # vLLM's hash of each block: its int event form (uint64), or bytes
    parent: int | bytes | None  # the hash of the block before the first (None: a prompt's first)
    tokens: np.ndarray  # int32
    extra_keys: list | None  # vLLM's per-block event form; None: no block has any
    lora: tuple[int, str] | None  # (id, name)
    media: int = 0  # a bit per tier (MEDIA) it was last reported stored in

    def nbytes(self) -> int:
        hashes = self.hashes.nbytes if isinstance(self.hashes, np.ndarray) else 48 * len(self.hashes)
        return self.tokens.nbytes + hashes + OBJECT_BYTES


class KVEventFeed:
    def __init__(self, backend, keyspaces, attn_groups: list[int], block_size: int, kv_cache_config):
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core import kv_cache_utils as kcu

        self._stored, self._removed = BlockStored, BlockRemoved
        # vLLM before its tagged hash keys (0.26) publishes extra keys as it hashes them.
        self._extras = (kcu.generate_block_hash_extra_keys, getattr(kcu, "to_event_extra_keys", list))
        # Its int form (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) asked once: vLLM reads the env per hash.
        self._ints = isinstance(kcu.maybe_convert_block_hash(bytes(32)), int)
        self.backend = backend
        self.keyspaces = keyspaces
        ks = keyspaces[0]  # the log names every shard's object: one of them stands for the chunk
        self.prefix = ks.namespace + "/"
        self._key = re.compile(rf"^{re.escape(ks.namespace)}/g(\d+)/{re.escape(ks.shard)}/"
                               rf"{re.escape(ks.span)}/([0-9a-f]{{32}})$")
        self.groups = tuple(attn_groups)
        self.block_size = block_size
        # request.block_hashes come every hash_block_size tokens, each over the whole prefix.
        self.hash_block = getattr(kv_cache_config, "hash_block_size", None) or block_size
        self._objects: OrderedDict[tuple[int, str], _Object] = OrderedDict()
        self._bytes = 0
        self._pending: dict[tuple[int, str], float] = {}  # no log: planned, not yet seen (when)
        self._recheck: set[tuple[int, str]] = set()  # no log: reported, then a load of it failed
        self.has_log: bool | None = None  # known at the first answer
        self._cursor = 0
        self._epoch: str | None = None
        self.lost = 0  # log entries the pool dropped before we read them
        self._ready: list = []  # translated, not yet taken
        self._lock = threading.Lock()

    # -- the scheduler's thread ------------------------------------------------
    def planned(self, request, objects: list[tuple[str, int, int]]) -> None:
        """Saves of ``request``'s objects ((chunk hash, first token, end token) each) are planned."""
        vhashes, hb, bs = request.block_hashes, self.hash_block, self.block_size
        lora = request.lora_request
        extra_keys, to_event = self._extras
        now = time.monotonic()
        for chunk_hash, start, end in objects:
            if end // hb > len(vhashes):  # not hashed by vLLM (yet): not reported
                continue
            raw = [vhashes[e // hb - 1] for e in range(start + bs, end + 1, bs)]
            extras = to_event([extra_keys(request, b, b + bs, 0)[0] for b in range(start, end, bs)])
            obj = _Object(np.fromiter(map(_low64, raw), np.uint64, len(raw)) if self._ints else raw,
                          (_low64 if self._ints else bytes)(vhashes[start // hb - 1]) if start else None,
                          np.asarray(request.all_token_ids[start:end], dtype=np.int32),
                          extras if any(extras) else None, (lora.adapter_id, lora.name) if lora else None)
            with self._lock:
                for g in self.groups:
                    self._track((g, chunk_hash), replace(obj))
                    if not self.has_log:
                        self._pending[(g, chunk_hash)] = now

    def failed(self, chunk_hashes: list[str]) -> None:
        """The worker's loads of these chunks failed: without a log, ask whether they are gone."""
        if self.has_log is False:
            with self._lock:
                self._recheck.update(k for h in chunk_hashes for g in self.groups
                                     if (k := (g, h)) in self._objects)

    def take(self) -> list:
        """The events ready since the last call (no pool call)."""
        with self._lock:
            out, self._ready = self._ready, []
        return out

    # -- the lookup thread ---------------------------------------------------------
    def fetch(self) -> None:
        """One pool call (two when a restarted pool's log starts again): the log's new
        entries or, without a log, whether the objects in question are there."""
        try:
            if self.has_log is not False:
                self._read_log()
            if self.has_log is False:
                self._ask()
        except BackendUnavailable:
            pass  # asked again next step

    def _read_log(self) -> None:
        reply = self.backend.events(self._cursor)
        if reply is None:
            self.has_log = False
            return
        if reply["epoch"] != self._epoch and self._cursor:
            reply = self.backend.events(0)  # a restarted pool: its log starts again
        restarted = self._epoch is not None and reply["epoch"] != self._epoch
        self._epoch, self._cursor = reply["epoch"], reply["cursor"]
        if reply["lost"]:
            self.lost += reply["lost"]
            log.warning("KV events: %d pool events were lost (read too late)", reply["lost"])
        with self._lock:
            if not self.has_log:
                self.has_log, self._pending = True, {}
            # A restarted pool holds only what its log now reports (its disk tier).
            out = self._forget_all() if restarted else []
            for code, key in zip(reply["codes"], reply["event_keys"]):
                m = self._key.match(key) if key.startswith(self.prefix) else None
                obj = self._objects.get((int(m.group(1)), m.group(2))) if m else None
                if obj is not None:  # else another engine's object, or one dropped from the map
                    self._note(out, (int(m.group(1)), m.group(2)), obj, code % 2, code // 2 == STORED)
            self._ready += out

    def _ask(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._pending = {k: t for k, t in self._pending.items()
                             if now - t < PENDING_S and k in self._objects}
            todo = list(self._pending) + list(self._recheck - self._pending.keys())
        if not todo:
            return
        n = len(self.keyspaces)
        found = self.backend.exists([ks.key(g, h) for g, h in todo for ks in self.keyspaces])
        with self._lock:
            out = []
            for i, key in enumerate(todo):
                there, obj = all(found[i * n:(i + 1) * n]), self._objects.get(key)
                if obj is None:
                    continue
                if key in self._pending:
                    if there:
                        del self._pending[key]
                        self._note(out, key, obj, 0, True)
                elif not there:
                    self._note(out, key, obj, 0, False)
            self._recheck -= set(todo)
            self._ready += out

    # -- under the lock ----------------------------------------------------------------
    def _track(self, key: tuple[int, str], obj: _Object) -> None:
        old = self._objects.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes()
            obj.media = old.media
        self._objects[key] = obj
        self._bytes += obj.nbytes()
        while self._bytes > TRACKED_BYTES:  # the least recently stored: its events stop here
            _, gone = self._objects.popitem(last=False)
            self._bytes -= gone.nbytes()

    def _note(self, out: list, key: tuple[int, str], obj: _Object, tier: int, stored: bool) -> None:
        """``obj`` entered (``stored``) or left the tier ``tier``: one event, unless reported so."""
        bit = 1 << tier
        if stored == bool(obj.media & bit):
            return
        obj.media ^= bit
        hashes = obj.hashes.tolist() if self._ints else list(obj.hashes)
        if stored:
            self._objects.move_to_end(key)
            lora_id, lora_name = obj.lora or (None, None)
            out.append(self._stored(block_hashes=hashes, parent_block_hash=obj.parent,
                                    token_ids=obj.tokens.tolist(), block_size=self.block_size,
                                    lora_id=lora_id, medium=MEDIA[tier], lora_name=lora_name,
                                    extra_keys=obj.extra_keys or [None] * len(hashes), group_idx=key[0]))
            return
        last = out[-1] if out else None
        if isinstance(last, self._removed) and (last.medium, last.group_idx) == (MEDIA[tier], key[0]):
            last.block_hashes.extend(hashes)  # one event for a run of one tier and group
        else:
            out.append(self._removed(block_hashes=hashes, medium=MEDIA[tier], group_idx=key[0]))

    def _forget_all(self) -> list:
        log.info("KV events: the pool restarted; what it held is reported removed, what it kept stored again")
        out: list = []
        for key, obj in self._objects.items():
            for tier in range(len(MEDIA)):
                self._note(out, key, obj, tier, False)
        return out


def _low64(block_hash: bytes) -> int:
    """vLLM's int event form of a block hash (``maybe_convert_block_hash``): its low 64 bits."""
    return int.from_bytes(block_hash[-8:], "big")
