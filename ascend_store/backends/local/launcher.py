"""Find a pool at the configured socket, or start one that serves as long as any client is open."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time

import zmq

from ascend_store.backends.local import protocol, trust
from ascend_store.backends.local.arena import gc_arenas
from ascend_store.backends.local.clients import alive, start_lock

__all__ = ["ensure_pool", "gc_arenas", "ping"]
log = logging.getLogger("ascend_store.pool")
START_TIMEOUT_S = 20.0
LOG_TAIL_BYTES = 2000
_failed: set[str] = set()  # sockets this process could not start a pool at (logged once)


def ping(socket_path: str, timeout_s: float = 0.5) -> dict | None:
    """The pool's hello reply, or None when nothing answers at ``socket_path``."""
    if not os.path.exists(socket_path):
        return None
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
    try:
        s.connect(f"ipc://{socket_path}")
        s.send_multipart([b"ping", protocol.pack({"op": "hello"})])
        if s.poll(int(timeout_s * 1000)):
            return protocol.unpack_reply(s.recv_multipart()[-1])
        return None
    except protocol.ProtocolError:
        return None
    finally:
        s.close(0)
        ctx.term()


def _open_private(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _log_tail(path: str, start: int) -> str:
    """What the pool wrote to its log since ``start`` (its last LOG_TAIL_BYTES)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(start, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            return f.read().decode(errors="replace").strip() or "(empty)"
    except OSError as exc:
        return f"(unreadable: {exc.strerror})"


def ensure_pool(cfg, attach=None) -> int | None:
    """Start a pool at ``cfg.socket`` unless one answers; return the pid of the pool we started.

    Nothing is adopted or started where the trust checks fail (trust.py): the client then
    refuses the pool with one clear error and requests recompute. ``attach()`` (the
    client's lock file, clients.py) runs first: a pool deciding to exit for want of
    clients sees it, or holds the lock file next to the socket until it is gone, so we
    start another. That lock also makes concurrent starters (scheduler and workers of one
    engine, or several engines) agree on one pool. The pool runs in a session of its own
    and exits ``cfg.idle_exit_s`` after its last client is gone, whichever client started
    it. Failing to start is logged once per socket with the tail of the pool's own log,
    not raised.
    """
    uids = trust.trusted_uids(cfg.trusted_uid)
    if cfg.socket in _failed:
        return None
    try:
        trust.prepare_dir(os.path.dirname(cfg.socket), uids)
        if os.path.lexists(cfg.socket):
            trust.check_socket(cfg.socket, uids)
    except trust.UntrustedPool as exc:
        log.debug("not starting a pool: %s", exc)  # the client reports it on its first call
        return None
    if attach is not None:
        attach()
    if ping(cfg.socket):
        return None
    lock = start_lock(cfg.socket)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ping(cfg.socket):
            return None
        return _start(cfg)
    finally:
        os.close(lock)


def _start(cfg) -> int | None:
    """Start a pool and return its pid once it answers. It is started through ``sh``, which
    exits at once, so the pool is no descendant of this process: vLLM's shutdown kills
    every descendant of the engine with SIGKILL, which would leave the arena behind and end
    the pool under the other engines using it."""
    cmd = [sys.executable, "-m", "ascend_store.ops.cli", "pool", "serve", "--socket", cfg.socket,
           "--capacity", str(cfg.capacity), "--lease-ttl", str(cfg.lease_ttl_s),
           "--idle-exit", str(cfg.idle_exit_s)]
    if cfg.disk_path:
        cmd += ["--disk-path", cfg.disk_path, "--disk-capacity", str(cfg.disk_capacity),
                "--disk-codec", cfg.disk_codec]
    # The pool must not hold the engine's stdout/stderr open (a supervisor reading them
    # would wait for the pool): it logs beside its socket instead.
    log_path = cfg.socket + ".log"
    log_fd = _open_private(log_path, os.O_WRONLY | os.O_APPEND)
    try:
        start = os.fstat(log_fd).st_size
        trampoline = subprocess.run(["sh", "-c", '"$@" </dev/null >/dev/null & echo $!', "sh", *cmd],
                                    start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=log_fd, text=True, timeout=START_TIMEOUT_S)
    finally:
        os.close(log_fd)
    pid = int(trampoline.stdout.strip() or 0)
    deadline = time.monotonic() + START_TIMEOUT_S
    while pid and time.monotonic() < deadline:
        if ping(cfg.socket):
            log.info("started an embedded pool (pid %d) at %s", pid, cfg.socket)
            return pid
        if not alive(pid):
            break
        time.sleep(0.05)
    running = pid and alive(pid)
    if running:
        os.kill(pid, signal.SIGKILL)
    status = f"no answer within {START_TIMEOUT_S:.0f} s" if running else "it exited"
    _failed.add(cfg.socket)
    log.warning("could not start a pool at %s (%s); requests will recompute. Its log %s ends with:\n%s",
                cfg.socket, status, log_path, _log_tail(log_path, start))
    return None
