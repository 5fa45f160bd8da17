"""Client of the local pool: control messages over the socket, data through the arena.

Every call is bounded by ``timeout_s``. A call that times out closes its socket (a late
reply can never be mistaken for the next one) and raises ``BackendUnavailable``; the
next call reconnects. When the pool restarts its epoch changes and the client maps the
new arena before handing out offsets.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
import time

import numpy as np
import zmq

from ascend_store.backends.base import STATUSES, Backend, BackendUnavailable, Slot, Status
from ascend_store.backends.local import protocol
from ascend_store.backends.local.launcher import ensure_pool

log = logging.getLogger("ascend_store.pool")


class LocalBackend(Backend):
    def __init__(self, cfg, timeout_s: float = 5.0, map_arena: bool = True):
        self.cfg = cfg
        self.timeout_s = timeout_s
        self._map_arena = map_arena
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._seq = 0
        self._epoch: str | None = None
        self._evictions = 0
        self._mapped_epoch: str | None = None
        self._view: memoryview | None = None
        self.rpcs = 0
        self.owner = secrets.token_hex(8)  # lets this client re-reserve what it failed to commit
        self._proc = ensure_pool(cfg) if cfg.start == "auto" else None

    # -- transport ------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            if not os.path.exists(self.cfg.socket):
                raise BackendUnavailable(f"no pool at {self.cfg.socket}")
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{self.cfg.socket}")
            self._sock = s
        return self._sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _call(self, op: str, **fields) -> dict:
        with self._lock:
            reply = self._roundtrip(op, fields)
            self._evictions = reply.get("evictions", self._evictions)
            if reply["epoch"] != self._epoch:
                if self._epoch is not None:
                    log.warning("pool at %s restarted (epoch %s -> %s)", self.cfg.socket,
                                self._epoch, reply["epoch"])
                self._epoch = reply["epoch"]
                if self._map_arena and op != "hello":
                    self._remap(self._roundtrip("hello", {}))
            return reply

    def _roundtrip(self, op: str, fields: dict) -> dict:
        sock = self._socket()
        self._seq += 1
        tag = self._seq.to_bytes(8, "little")
        self.rpcs += 1
        try:
            sock.send_multipart([tag, protocol.pack({"op": op, **fields})], zmq.NOBLOCK)
            deadline = time.monotonic() + self.timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(max(1, int(left * 1000))):
                    continue
                frames = sock.recv_multipart()
                if len(frames) == 2 and frames[0] == tag:
                    reply = protocol.msgpack.unpackb(frames[1], raw=False)
                    if not reply.get("ok"):
                        raise BackendUnavailable(f"pool rejected {op}: {reply.get('error')}")
                    return reply
        except zmq.ZMQError as exc:
            self._drop_socket()
            raise BackendUnavailable(f"pool {op} failed: {exc}") from None
        self._drop_socket()
        raise BackendUnavailable(f"pool {op} timed out after {self.timeout_s}s")

    def _remap(self, hello: dict) -> None:
        fd = os.open(hello["arena"], os.O_RDWR)
        try:
            mm = mmap.mmap(fd, hello["capacity"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._view = memoryview(mm)
        self._mapped_epoch = hello["epoch"]

    # -- Backend --------------------------------------------------------------
    def generation(self) -> tuple[str, int] | None:
        return None if self._epoch is None else (self._epoch, self._evictions)

    def buffer(self) -> tuple[str, memoryview]:
        if self._view is None or self._mapped_epoch != self._epoch:
            hello = self._call("hello")
            with self._lock:
                self._remap(hello)
        return self._mapped_epoch, self._view

    def exists(self, keys):
        return self._call("exists", keys=keys)["found"] if keys else []

    def reserve(self, keys, sizes):
        if not keys:
            return []
        r = self._call("reserve", keys=keys, sizes=sizes, owner=self.owner)
        return self._slots(r["status"], r["offsets"], sizes)

    def commit(self, keys):
        return [Status(s) for s in self._call("commit", keys=keys)["status"]] if keys else []

    def abort(self, keys):
        if keys:
            self._call("abort", keys=keys)

    def lease(self, keys, sizes=None):
        if not keys:
            return []
        r = self._call("lease", keys=keys)
        return self._slots(r["status"], r["offsets"], r["sizes"])

    def release(self, keys):
        if keys:
            self._call("release", keys=keys)

    def remove(self, keys):
        return [Status(s) for s in self._call("remove", keys=keys)["status"]] if keys else []

    def stats(self):
        return self._call("stats")["stats"]

    def list(self, prefix: str = ""):
        return self._call("list", prefix=prefix)["entries"]

    def _slots(self, statuses: list[int], offsets: list[int], sizes: list[int]) -> list[Slot]:
        limit = len(self._view) if self._view is not None else self.cfg.capacity
        st, off = np.asarray(statuses), np.asarray(offsets, dtype=np.int64)
        out = (st == Status.OK) & ((off < 0) | (off + np.asarray(sizes, dtype=np.int64) > limit))
        if out.any():
            i = int(np.flatnonzero(out)[0])
            raise BackendUnavailable(f"pool returned an out-of-bounds slot {offsets[i]}+{sizes[i]}")
        return [Slot(STATUSES[s], o, n) for s, o, n in zip(statuses, offsets, sizes)]

    def close(self) -> None:
        with self._lock:
            self._drop_socket()
            self._ctx.term()
        self._view = None
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except Exception:
                self._proc.kill()
            self._proc = None
