"""The embedded pool's server: owns the shared-memory arena and its index.

One thread serves a ZeroMQ ROUTER socket on a Unix socket (mode 0600, in a private
directory: trust.py). Clients map the arena file themselves and copy bytes in and out;
the server only hands out offsets, so no KV byte ever crosses the socket. With a disk
tier (tiers.py) the server maps the arena too, to spill and promote objects. The arena
(arena.py) is created 0600 and fully backed, locked while the pool lives and removed on
every exit the pool sees (SIGTERM, SIGINT, SIGHUP, ``idle_exit_s`` after its last client
went (clients.py), its socket taken by another pool); arenas of pools that died unseen
are collected when a pool starts (see docs/reliability.md: every client of one pool
shares one trust domain).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import secrets
import shutil
import signal
import time

import numpy as np
import zmq

from ascend_store.backends.local import arena, protocol, trust
from ascend_store.backends.local.clients import SWEEP_S, Clients, alive, start_lock
from ascend_store.backends.local.disk import DiskError, DiskTier
from ascend_store.backends.local.index import PoolIndex
from ascend_store.backends.local.tiers import TieredIndex

log = logging.getLogger("ascend_store.pool")
REAP_INTERVAL_S = 0.1


def _arena_dir(socket_path: str, capacity: int) -> str:
    if os.path.isdir(arena.SHM) and shutil.disk_usage(arena.SHM).free >= capacity:
        return arena.SHM
    log.warning("/dev/shm is missing or smaller than the pool capacity; the arena lives "
                "beside the socket (page cache backed)")
    return os.path.dirname(socket_path)


class PoolServer:
    def __init__(self, socket_path: str, capacity: int, lease_ttl_s: float = 30.0,
                 parent_pid: int | None = None, disk_path: str | None = None, disk_capacity: int = 0,
                 idle_exit_s: float | None = None, disk_codec: str = "raw"):
        self.socket_path = os.path.abspath(socket_path)
        self.capacity = capacity
        self.parent_pid = parent_pid
        self.idle_exit_s = idle_exit_s  # exit this long after the last client went (None: never)
        self.clients = Clients(self.socket_path)
        self.epoch = secrets.token_hex(8)
        self.requests = 0
        self.rejected = 0
        # Keys asked per op, and keys repeated within one call: what the caches must keep low.
        self.key_queries: dict[str, int] = {}
        self.repeated_keys = 0
        trust.prepare_dir(os.path.dirname(self.socket_path), trust.trusted_uids(None))
        tag = hashlib.blake2b(self.socket_path.encode(), digest_size=6).hexdigest()
        arena_dir = _arena_dir(self.socket_path, capacity)
        arena.gc_arenas(arena_dir)  # arenas of pools that died without removing theirs
        self.arena_path, self._arena_fd = arena.create(arena_dir, arena.name(tag, self.epoch), capacity)
        try:
            if disk_path:  # the server itself copies only between the arena and the disk tier
                view = memoryview(mmap.mmap(self._arena_fd, capacity))
                self.index = TieredIndex(capacity, view, DiskTier(disk_path, disk_capacity, disk_codec),
                                         lease_ttl_s=lease_ttl_s, alive=self.clients.alive)
            else:
                self.index = PoolIndex(capacity, lease_ttl_s=lease_ttl_s, alive=self.clients.alive)
            self._bind()
        except BaseException:
            arena.remove(self.arena_path, self._arena_fd)
            raise
        self._running = True
        self._closed = False
        log.info("pool serving on %s, arena %s (%d bytes), epoch %s",
                 self.socket_path, self.arena_path, capacity, self.epoch)

    def _bind(self) -> None:
        self._ctx = zmq.Context(1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        if os.path.lexists(self.socket_path):
            os.unlink(self.socket_path)  # the launcher checked nobody answers there
        old_umask = os.umask(0o177)
        try:
            self._sock.bind(f"ipc://{self.socket_path}")
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, 0o600)
        self._socket_ino = os.lstat(self.socket_path).st_ino

    def stop(self, *_):
        self._running = False

    def serve_forever(self) -> None:
        last_reap = last_sweep = idle_since = time.monotonic()
        try:
            while self._running:
                if self._sock.poll(int(REAP_INTERVAL_S * 1000)):
                    frames = self._sock.recv_multipart()
                    if len(frames) >= 2:
                        self._sock.send_multipart(frames[:-1] + [self._handle(frames[-1])])
                now = time.monotonic()
                if now - last_reap >= REAP_INTERVAL_S:
                    last_reap = now
                    self.index.reap()
                    if self.parent_pid and not alive(self.parent_pid):
                        log.info("parent %d exited; stopping the pool", self.parent_pid)
                        break
                if now - last_sweep >= SWEEP_S:
                    last_sweep = now
                    if self._replaced():
                        log.info("another pool took the socket %s; stopping this one", self.socket_path)
                        break
                    if self.clients.sweep():
                        idle_since = now
                    elif self.idle_exit_s is not None and now - idle_since >= self.idle_exit_s \
                            and self._leaving():
                        log.info("no client for %.1f s; stopping the pool", now - idle_since)
                        break
        finally:
            self.close()

    def _replaced(self) -> bool:
        try:
            return os.lstat(self.socket_path).st_ino != self._socket_ino
        except FileNotFoundError:
            return False  # connected clients still reach it; it goes when they do

    def _leaving(self) -> bool:
        """Decide to exit: under the starters' lock, held until this process exits, no
        client may have come since the sweep (an engine checks for a pool under that
        lock, after creating its client file: it never adopts a pool that is going)."""
        try:
            fd = start_lock(self.socket_path)
        except OSError:
            return True  # its directory is gone: no engine can find this pool any more
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        if self.clients.sweep():
            os.close(fd)
            return False
        return True  # the fd stays open: the lock goes with the process

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close(0)
        self._ctx.term()
        if not self._replaced():
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
        try:
            if isinstance(self.index, TieredIndex):
                self.index.flush()
                self.index.close()
        finally:
            arena.remove(self.arena_path, self._arena_fd)

    def _handle(self, data: bytes) -> bytes:
        self.requests += 1
        try:
            msg = protocol.unpack_request(data)
        except protocol.ProtocolError as exc:
            self.rejected += 1
            return protocol.pack({"ok": False, "epoch": self.epoch, "error": str(exc)})
        keys = msg.get("keys", [])
        self.key_queries[msg["op"]] = self.key_queries.get(msg["op"], 0) + len(keys)
        self.repeated_keys += len(keys) - len(set(keys))
        reply = self._dispatch(msg["op"], keys, msg)
        reply.update(ok=True, epoch=self.epoch, gone=self.index.gone, added=self.index.added)
        if "since" in msg:
            reply["gone_keys"] = self.index.gone_since(msg["since"])
        return protocol.pack(reply)

    def _dispatch(self, op: str, keys: list[str], msg: dict) -> dict:
        ix = self.index
        if op == "hello":
            return {"arena": self.arena_path, "capacity": self.capacity, "pid": os.getpid()}
        if op == "exists":
            return {"found": ix.exists(keys)}
        if op == "tiers":
            return {"tier": ix.tiers(keys)}
        if op == "reserve":
            res = ix.reserve(keys, msg["sizes"], owner=msg.get("owner", ""))
            res = np.asarray(res, dtype="<i8").reshape(-1, 2)
            return {"status": res[:, 0].tobytes(), "offsets": res[:, 1].tobytes()}
        owner = msg.get("owner", "")
        if op == "commit":
            return {"status": [int(s) for s in ix.commit(keys, owner)]}
        if op == "abort":
            ix.abort(keys, owner)
            return {}
        if op == "lease":  # slots go back packed: int64 arrays, one entry per key
            res = np.asarray(ix.lease(keys, owner), dtype="<i8").reshape(-1, 3)
            return {"status": res[:, 0].tobytes(), "offsets": res[:, 1].tobytes(),
                    "sizes": res[:, 2].tobytes()}
        if op == "release":
            ix.release(keys, owner)
            return {}
        if op == "remove":
            return {"status": [int(s) for s in ix.remove(keys)]}
        if op == "stats":
            return {"stats": {**ix.stats(), "gone": ix.gone, "requests": self.requests,
                              "rejected": self.rejected, "events": ix.events.stats(),
                              "key_queries": self.key_queries, "repeated_keys": self.repeated_keys,
                              "clients": self.clients.sweep(),
                              "rss_bytes": _rss_bytes(), "pid": os.getpid(), "epoch": self.epoch}}
        if op == "events":
            return ix.events.since(msg.get("cursor", 0))
        if op == "list":
            return {"entries": ix.list(msg.get("prefix", ""))[:10000]}
        raise AssertionError(op)  # protocol.unpack_request admits only OPS


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def serve(socket_path: str, capacity: int, lease_ttl_s: float = 30.0,
          parent_pid: int | None = None, disk_path: str | None = None, disk_capacity: int = 0,
          idle_exit_s: float | None = None, disk_codec: str = "raw") -> None:
    """Run a pool until a signal, its parent's death or ``idle_exit_s`` without clients; a
    pool that cannot start logs why (the launcher shows that line in the engine's log) and
    exits with status 2."""
    def interrupted(signum, _frame):  # while starting: unwind, so the arena is removed
        raise SystemExit(128 + signum)

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for sig in signals:
        signal.signal(sig, interrupted)
    try:
        server = PoolServer(socket_path, capacity, lease_ttl_s=lease_ttl_s, parent_pid=parent_pid,
                            disk_path=disk_path, disk_capacity=disk_capacity, idle_exit_s=idle_exit_s,
                            disk_codec=disk_codec)
    except (arena.ArenaError, trust.UntrustedPool, DiskError) as exc:
        log.error("pool not started: %s", exc)
        raise SystemExit(2) from None
    for sig in signals:
        signal.signal(sig, server.stop)
    server.serve_forever()
