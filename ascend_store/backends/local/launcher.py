"""Find a pool at the configured socket, or start one that lives as long as this process."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import time

import zmq

from ascend_store.backends.local import protocol
from ascend_store.backends.local.server import prepare_socket_dir

log = logging.getLogger("ascend_store.pool")
START_TIMEOUT_S = 20.0


def ping(socket_path: str, timeout_s: float = 0.5) -> dict | None:
    """The pool's hello reply, or None when nothing answers at ``socket_path``."""
    if not os.path.exists(socket_path):
        return None
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(f"ipc://{socket_path}")
        s.send_multipart([b"ping", protocol.pack({"op": "hello"})])
        if s.poll(int(timeout_s * 1000)):
            return protocol.msgpack.unpackb(s.recv_multipart()[-1], raw=False)
        return None
    finally:
        s.close(0)
        ctx.term()


def ensure_pool(cfg) -> subprocess.Popen | None:
    """Start a pool at ``cfg.socket`` unless one answers; return the process we started.

    A lock file next to the socket makes concurrent starters (scheduler and workers of
    one engine, or several engines) agree on one pool. The child exits when this
    process does. Failing to start is logged, not raised: requests then recompute.
    """
    if ping(cfg.socket):
        return None
    prepare_socket_dir(cfg.socket)
    with open(cfg.socket + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ping(cfg.socket):
            return None
        cmd = [sys.executable, "-m", "ascend_store.cli", "pool", "serve", "--socket", cfg.socket,
               "--capacity", str(cfg.capacity), "--lease-ttl", str(cfg.lease_ttl_s),
               "--parent-pid", str(os.getpid())]
        # The pool must not hold the engine's stdout/stderr open (a supervisor reading them
        # would wait for the pool): it logs beside its socket instead.
        with open(cfg.socket + ".log", "ab") as log_file:
            proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=log_file)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if ping(cfg.socket):
                log.info("started an embedded pool (pid %d) at %s", proc.pid, cfg.socket)
                return proc
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        log.warning("could not start a pool at %s; requests will recompute", cfg.socket)
        proc.kill()
        return None
