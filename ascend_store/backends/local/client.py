"""Client of the local pool: control messages over the socket, data through the arena.

Every call is bounded by ``timeout_s``. A call that times out closes its socket (a late
reply can never be mistaken for the next one) and raises ``BackendUnavailable``; the
next call reconnects. When the pool restarts its epoch changes and the client maps the
new arena before handing out offsets. Before connecting and before mapping, the socket,
its directory and the arena must pass trust.py's checks; a pool that fails them is
refused (``UntrustedPool``) and requests recompute. Replies are decoded under bounds.
Each reply says which objects the pool deleted since the last one (``generation()``).
While open, the client holds its lock file beside the socket (clients.py): the pool keeps
its leases and reservations until it exits, and serves as long as any client is open,
whichever started it (``start: auto``; closing never stops the pool).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

import numpy as np
import zmq

from ascend_store.backends.base import STATUSES, Backend, BackendUnavailable, Generation, Slots, Status
from ascend_store.backends.local import protocol, trust
from ascend_store.backends.local.arena import abandoned
from ascend_store.backends.local.clients import ClientFile
from ascend_store.backends.local.launcher import ensure_pool

log = logging.getLogger("ascend_store.pool")
RECENT_GONE = 8192  # digests of deleted objects kept for generation()
RESTART_EVERY_S = 10.0  # start: auto: how often a client may try to start a pool it found dead
_NONE_GONE = np.zeros(0, dtype="<u8")


class LocalBackend(Backend):
    def __init__(self, cfg, timeout_s: float = 5.0, map_arena: bool = True):
        self.cfg = cfg
        self.timeout_s = timeout_s
        self._map_arena = map_arena
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._seq = 0
        self._uids = trust.trusted_uids(cfg.trusted_uid)
        self._epoch: str | None = None
        self._generation: Generation | None = None
        self._mapped_epoch: str | None = None
        self._view: memoryview | None = None
        self._arena_path: str | None = None  # the pool's, as of its last hello
        self._next_start = 0.0
        self.rpcs = 0
        # Names this client's leases and reservations (and its lock file), so it may
        # re-reserve what it failed to commit and the pool knows when they are safe to drop.
        self.owner = secrets.token_hex(8)
        self._file = ClientFile(cfg.socket, self.owner)
        # The pid of the pool this client started, if any: it goes when its last client has gone.
        self.started = ensure_pool(cfg, attach=self._file.open) if cfg.start == "auto" else None

    # -- transport ------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            trust.check_socket(self.cfg.socket, self._uids)
            self._file.open()
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
            s.connect(f"ipc://{self.cfg.socket}")
            self._sock = s
        return self._sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _call(self, op: str, **fields) -> dict:
        with self._lock:
            if self._generation is not None:
                fields["since"] = self._generation.gone
            try:
                reply = self._roundtrip(op, fields)
            except BackendUnavailable:
                self._start_if_dead()
                raise
            self._note_gone(reply)
            if reply["epoch"] != self._epoch:
                if self._epoch is not None:
                    log.warning("pool at %s restarted (epoch %s -> %s)", self.cfg.socket,
                                self._epoch, reply["epoch"])
                self._epoch = reply["epoch"]
                if op != "hello":
                    try:  # a scheduler's client only checks the arena: lookups must not trust it either
                        self._remap(self._roundtrip("hello", {}), self._map_arena)
                    except BackendUnavailable:
                        self._epoch = None  # check again on the next call, never hand out slots unchecked
                        raise
            return reply

    def _roundtrip(self, op: str, fields: dict) -> dict:
        sock = self._socket()
        self._seq += 1
        tag = self._seq.to_bytes(8, "little")
        self.rpcs += 1
        try:
            sock.send_multipart([tag, protocol.pack({"op": op, "owner": self.owner, **fields})], zmq.NOBLOCK)
            deadline = time.monotonic() + self.timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(max(1, int(left * 1000))):
                    continue
                frames = sock.recv_multipart()
                if len(frames) == 2 and frames[0] == tag:
                    try:
                        reply = protocol.unpack_reply(frames[1])
                    except protocol.ProtocolError as exc:
                        self._drop_socket()
                        raise BackendUnavailable(f"pool {op}: {exc}") from None
                    if not reply["ok"]:
                        raise BackendUnavailable(f"pool rejected {op}: {reply.get('error')}")
                    return reply
        except zmq.ZMQError as exc:
            self._drop_socket()
            raise BackendUnavailable(f"pool {op} failed: {exc}") from None
        self._drop_socket()
        raise BackendUnavailable(f"pool {op} timed out after {self.timeout_s}s")

    def _note_gone(self, reply: dict) -> None:
        """Advance the generation from a reply (one assignment: readers see it whole)."""
        gone, digests, added = reply.get("gone"), reply.get("gone_keys"), reply.get("added")
        if not isinstance(gone, int) or gone < 0 or not isinstance(added, int) or added < 0:
            raise BackendUnavailable("pool reply without valid 'gone' and 'added' counts")
        old = self._generation
        recent = _NONE_GONE
        if old is not None and old.epoch == reply["epoch"] and isinstance(digests, bytes) \
                and len(digests) == 8 * (gone - old.gone):
            recent = old.recent
            if digests:
                recent = np.concatenate((recent, np.frombuffer(digests, dtype="<u8")))[-RECENT_GONE:]
        # Otherwise (first reply, new epoch, a pool that forgot): no digests, caches drop all hits.
        self._generation = Generation(reply["epoch"], gone, recent, added)

    def _start_if_dead(self) -> None:
        """``start: auto``: a pool found dead (its socket gone, or its arena no longer held
        by a running pool) is started again, off this thread; ``ensure_pool`` elects one
        starter among every engine's clients. A pool that is only slow is left alone."""
        now = time.monotonic()
        if self.cfg.start != "auto" or now < self._next_start:
            return
        if os.path.exists(self.cfg.socket) and not (self._arena_path and abandoned(self._arena_path)):
            return
        self._next_start = now + RESTART_EVERY_S
        threading.Thread(target=ensure_pool, args=(self.cfg, self._file.open), daemon=True,
                         name="ascend-store-pool-start").start()

    def _remap(self, hello: dict, map_it: bool = True) -> None:
        mm = trust.check_arena(hello.get("arena"), hello.get("capacity"), self._uids, map_it)
        self._arena_path = hello["arena"]
        if mm is not None:
            self._view = memoryview(mm)
            self._mapped_epoch = hello["epoch"]

    # -- Backend --------------------------------------------------------------
    def generation(self) -> Generation | None:
        return self._generation

    def buffer(self) -> tuple[str, memoryview]:
        if self._view is None or self._mapped_epoch != self._epoch:
            hello = self._call("hello")
            with self._lock:
                try:
                    self._remap(hello)
                except BackendUnavailable:
                    self._epoch = None
                    raise
        return self._mapped_epoch, self._view

    def exists(self, keys):
        return _per_key(self._call("exists", keys=keys), "found", len(keys)) if keys else []

    def tiers(self, keys):
        return _per_key(self._call("tiers", keys=keys), "tier", len(keys)) if keys else []

    def reserve(self, keys, sizes):
        return self.reserve_slots(keys, sizes).to_list()

    def reserve_slots(self, keys, sizes) -> Slots:
        sizes = np.asarray(sizes, dtype=np.int64)
        if not keys:
            return _NO_SLOTS
        r = self._call("reserve", keys=keys, sizes=sizes.astype("<i8").tobytes())
        n = len(keys)
        return self._slots(_packed(r, "status", n), _packed(r, "offsets", n), sizes)

    def commit(self, keys):
        return _statuses(self._call("commit", keys=keys), len(keys)) if keys else []

    def abort(self, keys):
        if keys:
            self._call("abort", keys=keys)

    def lease(self, keys, sizes=None):
        return self.lease_slots(keys).to_list()

    def lease_slots(self, keys, sizes=None) -> Slots:
        if not keys:
            return _NO_SLOTS
        r = self._call("lease", keys=keys)
        n = len(keys)
        return self._slots(_packed(r, "status", n), _packed(r, "offsets", n), _packed(r, "sizes", n))

    def release(self, keys):
        if keys:
            self._call("release", keys=keys)

    def remove(self, keys):
        return _statuses(self._call("remove", keys=keys), len(keys)) if keys else []

    def stats(self):
        return self._call("stats")["stats"]

    def events(self, cursor: int) -> dict:
        reply = self._call("events", cursor=cursor)
        codes, keys = reply.get("codes"), reply.get("event_keys")
        if not isinstance(codes, bytes) or not isinstance(keys, list) or len(codes) != len(keys) \
                or not isinstance(reply.get("cursor"), int) or not isinstance(reply.get("lost"), int):
            raise BackendUnavailable("pool reply to 'events' is malformed")
        return reply

    def list(self, prefix: str = ""):
        return self._call("list", prefix=prefix)["entries"]

    def _slots(self, st: np.ndarray, off: np.ndarray, sz: np.ndarray) -> Slots:
        """Checked slots: known statuses, and every OK slot inside the arena."""
        limit = len(self._view) if self._view is not None else self.cfg.capacity
        if ((st < 0) | (st >= len(STATUSES))).any():
            raise BackendUnavailable("pool returned an unknown status")
        out = (st == Status.OK) & ((off < 0) | (sz < 0) | (off + sz > limit))
        if out.any():
            i = int(np.flatnonzero(out)[0])
            raise BackendUnavailable(f"pool returned an out-of-bounds slot {off[i]}+{sz[i]}")
        return Slots(st, off, sz)

    def close(self) -> None:
        with self._lock:
            self._drop_socket()
            self._ctx.term()
        self._view = None
        self._file.close()  # the pool goes idle_exit_s after its last client


def _packed(reply: dict, name: str, n: int) -> np.ndarray:
    """A reply's per-key int64 array (packed little-endian), one entry per key asked."""
    value = reply.get(name)
    if not isinstance(value, bytes) or len(value) != 8 * n:
        raise BackendUnavailable(f"pool reply has no {n}-entry packed '{name}' array")
    return np.frombuffer(value, dtype="<i8").astype(np.int64)


_NO_SLOTS = Slots(*(np.zeros(0, dtype=np.int64) for _ in range(3)))


def _per_key(reply: dict, name: str, n: int) -> list:
    """A reply's per-key list, which must have one entry per key asked."""
    value = reply.get(name)
    if not isinstance(value, list) or len(value) != n:
        raise BackendUnavailable(f"pool reply has no {n}-entry '{name}' list")
    return value


def _statuses(reply: dict, n: int) -> list[Status]:
    values = _per_key(reply, "status", n)
    if not all(type(s) is int and 0 <= s < len(STATUSES) for s in values):
        raise BackendUnavailable("pool returned an unknown status")
    return [STATUSES[s] for s in values]
