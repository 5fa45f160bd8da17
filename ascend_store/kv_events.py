"""KV events for the pool's tiers: the scheduler turns the pool's event log into vLLM's
``BlockStored`` / ``BlockRemoved``, which vLLM publishes on its ``kv_events_config`` publisher.

Stores and evictions happen in the pool process, so the connector learns of them from the
pool's event log (backends/local/events.py): ``take_events``, which vLLM's scheduler calls
once per step, asks for the entries after the last one it saw (one ``events`` call per step,
only when ``kv_events_config.enable_kv_cache_events`` is on; none otherwise). Each chunk
object of this engine's first key space (its first shard and layer span, keys.KeySpace)
becomes one hash in an event (the other shards and spans hold the same chunk); consecutive
entries of one kind, tier and KV cache group are
one event. The hash is the chunk's chain hash (its key's last component, 16 bytes) in the
form vLLM uses for its own events (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: its low 64
bits as an int, by default); ``block_size`` is the chunk's tokens. Token ids and the parent
hash are not known to the pool and are left empty, as vLLM's own offloading connector does
for objects it has no metadata for. Every engine on one pool reports the pool's events:
any of them can load what the pool holds. The medium is ``CPU`` for the memory tier and
``DISK`` for the disk tier; a spill is ``BlockRemoved(CPU)`` + ``BlockStored(DISK)``.
"""

from __future__ import annotations

import logging
import re

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.local.events import MEDIA, STORED

log = logging.getLogger("ascend_store")


def enabled(vllm_config) -> bool:
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(cfg is not None and getattr(cfg, "enable_kv_cache_events", False))


class KVEventFeed:
    def __init__(self, backend, keyspace, chunk_tokens: int):
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._stored, self._removed, self._convert = BlockStored, BlockRemoved, maybe_convert_block_hash
        self.backend = backend
        self.prefix = keyspace.namespace + "/"
        self._key = re.compile(rf"^{re.escape(keyspace.namespace)}/g(\d+)/{re.escape(keyspace.shard)}/"
                               rf"{re.escape(keyspace.span)}/([0-9a-f]{{32}})$")
        self.chunk_tokens = chunk_tokens
        self._cursor = 0
        self._epoch: str | None = None
        self.lost = 0  # log entries the pool dropped before we read them

    def take(self) -> list:
        try:
            reply = self.backend.events(self._cursor)
            if reply is not None and reply["epoch"] != self._epoch and self._cursor:
                reply = self.backend.events(0)  # a restarted pool: its log starts again
        except BackendUnavailable:
            return []
        if reply is None:
            return []
        if reply["epoch"] != self._epoch:
            if self._epoch is not None:
                log.info("KV events: the pool restarted; what it held in memory is not reported removed")
            self._epoch = reply["epoch"]
        self._cursor = reply["cursor"]
        if reply["lost"]:
            self.lost += reply["lost"]
            log.warning("KV events: %d pool events were lost (read too late)", reply["lost"])
        return self._translate(reply["codes"], reply["event_keys"])

    def _translate(self, codes: bytes, keys: list[str]) -> list:
        events, run, hashes = [], None, []
        for code, key in zip(codes, keys):
            m = self._key.match(key) if key.startswith(self.prefix) else None
            if m is None:
                continue
            this = (code, int(m.group(1)))
            if this != run:
                self._emit(events, run, hashes)
                run, hashes = this, []
            hashes.append(self._convert(bytes.fromhex(m.group(2))))
        self._emit(events, run, hashes)
        return events

    def _emit(self, events: list, run, hashes: list) -> None:
        if not hashes:
            return
        code, group = run
        medium = MEDIA[code % 2]
        if code // 2 == STORED:
            events.append(self._stored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                                       block_size=self.chunk_tokens, lora_id=None, medium=medium,
                                       lora_name=None, group_idx=group))
        else:
            events.append(self._removed(block_hashes=hashes, medium=medium, group_idx=group))
