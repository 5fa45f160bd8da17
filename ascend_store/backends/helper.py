"""The owner's side of a store helper process (helper_main.py): start it, call it with a
deadline, replace it when it hangs or dies.

A store binding may hold the GIL while it waits on a stuck service (Mooncake's does while
it sets a client up), which would freeze every thread of the engine, timeouts included.
Its client therefore runs in a process of its own; a call here only waits on a socket.

Discipline, as the local pool's client: one call at a time, each with an id its reply
must carry and a deadline. A call that misses its deadline gets the helper killed and
reaped, which ends whatever transfer it was doing: only then is the staging memory of the
failed call reused (``after_transfers``). The next call starts a new helper. Setting a
client up (connecting, registering memory) has a deadline of its own, before the call's:
a call that finds it still under way at that deadline fails and leaves it running, for up
to ``SETUP_DEADLINES`` deadlines in all; then the helper counts as stuck.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.helper_protocol import Reply, Request, frame_length

log = logging.getLogger("ascend_store")
SETUP_DEADLINES = 10  # a client set-up may take this many call deadlines before it counts as stuck
REAP_S = 5.0  # how long a killed helper may take to exit before its memory is left for later
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Spawner:
    """Starts helpers from one thread that lives as long as the process: a child's
    parent-death signal fires when the thread that started it exits, and the threads that
    call a backend may come and go."""

    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue | None = None
        self._pid = 0

    def popen(self, argv: list[str], fds: tuple[int, ...]) -> subprocess.Popen:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: threads do not survive fork
                self._jobs, self._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(target=self._serve, args=(self._jobs,), name="ascend-store-spawner",
                                 daemon=True).start()
            box: queue.SimpleQueue = queue.SimpleQueue()
            self._jobs.put((argv, fds, box))
            out = box.get()
        if isinstance(out, OSError):
            raise BackendUnavailable(f"starting the store helper failed: {out}")
        return out

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            argv, fds, box = jobs.get()
            # This package, however the owner found it (an installed copy or a checkout).
            path = os.pathsep.join(filter(None, (_PACKAGE_ROOT, os.environ.get("PYTHONPATH"))))
            try:
                box.put(subprocess.Popen(argv, pass_fds=fds, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONPATH": path}))
            except OSError as exc:
                box.put(exc)


_SPAWNER = _Spawner()


class StoreHelper:
    """One backend's helper: ``client`` ("module:Class", a helper_protocol.StoreClient) built
    in it from ``spec``, over the staging buffer ``mem_fd`` of ``mem_size`` bytes."""

    def __init__(self, client: str, spec: dict, mem_fd: int, mem_size: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.setup_s = SETUP_DEADLINES * timeout_s
        self._spec = json.dumps({"client": client, **spec})
        self._mem = (mem_fd, mem_size)
        self._lock = threading.Lock()  # one call at a time
        self._reaping = threading.Lock()  # guards _dying and _after
        self._closed = False
        self._ids = itertools.count(1)
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._rbuf = bytearray()
        self._ready = False
        self._setup: tuple[int, float] | None = None  # (request id, since) of a set-up under way
        self._dying: list[subprocess.Popen] = []  # killed, not yet reaped
        self._after: list = []  # run once every killed helper is reaped
        self._pid = os.getpid()
        self.setups = 0  # clients set up so far (helpers replaced, services restarted)

    # -- calls ------------------------------------------------------------------
    def call(self, op: str, keys: list[str], offsets=None, sizes=None) -> np.ndarray:
        """Run one store call in the helper; BackendUnavailable when it fails or misses
        its deadline (the helper is then replaced)."""
        if not self._lock.acquire(timeout=self.timeout_s):
            raise BackendUnavailable(f"store {op}: the client is busy past the deadline")
        # The deadline starts once the client is ours: a call that waited its turn must not
        # find no time left and take a healthy helper for a hung one.
        deadline = time.monotonic() + self.timeout_s
        try:
            if self._closed:
                raise BackendUnavailable("backend closed")
            self._reap()
            self._start()
            if not self._ready:
                self._set_up(deadline)
                # Its own deadline for the call: a set-up that took most of this one must not
                # leave the call too little time and get a healthy helper killed.
                deadline = time.monotonic() + self.timeout_s
            rid = self._send(Request(next(self._ids), op, keys, _arr(offsets), _arr(sizes)), deadline)
            reply = self._wait(rid, deadline)
            if reply is None:
                self._kill()
                raise BackendUnavailable(f"store {op} timed out after {self.timeout_s}s")
            if reply.reset:
                self._kill()  # it answered: no transfer of its can still run
            if reply.error:
                raise BackendUnavailable(reply.error)
            return reply.values
        finally:
            self._lock.release()

    def start(self) -> None:
        """Start the helper and its client's set-up now, without waiting: an engine's first
        lookups then find it ready (a helper takes ~0.2 s to start)."""
        with self._lock:
            try:
                self._start()
                if not self._ready and self._setup is None:
                    self._begin_setup(time.monotonic() + self.timeout_s)
            except BackendUnavailable as exc:
                log.debug("KV store helper not started yet: %s", exc)

    def after_transfers(self, fn) -> None:
        """Run ``fn`` (freeing a failed call's staging) once no transfer a failed call
        started can still touch memory: now, unless a killed helper is not reaped yet."""
        with self._reaping:
            self._after.append(fn)
        self._reap()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._ready and self._proc is not None and self._pid == os.getpid():
                deadline = time.monotonic() + self.timeout_s
                try:  # memcache's client wants an orderly close
                    self._wait(self._send(Request(next(self._ids), "close"), deadline), deadline)
                except BackendUnavailable:
                    pass
            self._kill()

    # -- the helper process -------------------------------------------------------
    def _start(self) -> None:
        if self._pid != os.getpid():  # a forked child: the helper is its parent's
            self._proc = self._sock = None
            self._dying, self._pid = [], os.getpid()
            self._ready, self._setup = False, None
        if self._proc is not None and self._proc.poll() is not None:
            log.warning("KV store helper process exited (%s); starting another", self._proc.returncode)
            self._kill()
        if self._proc is not None:
            return
        ours, theirs = socket.socketpair()
        try:
            mem_fd, size = self._mem
            argv = [sys.executable, "-m", "ascend_store.backends.helper_main", str(theirs.fileno()),
                    str(mem_fd), str(size), str(os.getpid()), self._spec]
            self._proc = _SPAWNER.popen(argv, (theirs.fileno(), mem_fd))
        except BackendUnavailable:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock, self._rbuf, self._ready, self._setup = ours, bytearray(), False, None

    def _set_up(self, deadline: float) -> None:
        if self._setup is None:
            self._begin_setup(deadline)
        rid, since = self._setup
        reply = self._wait(rid, deadline)
        if reply is None:
            if time.monotonic() - since > self.setup_s:
                self._kill()
                raise BackendUnavailable(f"setting up the store client took over {self.setup_s:.0f}s")
            raise BackendUnavailable("the store client is still being set up")
        self._setup = None
        if reply.error:
            if reply.reset:
                self._kill()
            raise BackendUnavailable(reply.error)
        self._ready = True
        self.setups += 1

    def _begin_setup(self, deadline: float) -> None:
        self._setup = (self._send(Request(next(self._ids), "setup"), deadline), time.monotonic())

    def _kill(self) -> None:
        """Kill the helper and reap it (a killed process does no more transfers)."""
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        self._ready, self._setup = False, None
        if sock is not None:
            sock.close()
        if proc is not None:
            proc.kill()
            with self._reaping:
                self._dying.append(proc)
        self._reap(REAP_S)

    def _reap(self, wait_s: float = 0.0) -> None:
        with self._reaping:
            for proc in self._dying:
                try:
                    proc.wait(wait_s)
                except subprocess.TimeoutExpired:
                    log.warning("KV store helper %d not gone %.0fs after SIGKILL; its staging memory "
                                "stays reserved until it is", proc.pid, wait_s)
            self._dying = [p for p in self._dying if p.returncode is None]
            after = [] if self._dying else self._after
            if not self._dying:
                self._after = []
        for fn in after:
            fn()

    # -- framing ----------------------------------------------------------------
    def _send(self, req: Request, deadline: float) -> int:
        data = memoryview(req.pack())
        try:
            while data:
                if not self._poll(select.POLLOUT, max(0.0, deadline - time.monotonic())):
                    raise OSError("the helper takes no requests")
                data = data[self._sock.send(data):]
        except OSError as exc:
            self._kill()
            raise BackendUnavailable(f"store helper unreachable: {exc}") from None
        return req.id

    def _wait(self, rid: int, deadline: float) -> Reply | None:
        """The reply to request ``rid``, or None at the deadline. Replies to other ids are
        dropped: a late answer is never taken for the one awaited."""
        try:
            while True:
                while (body := self._frame()) is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._poll(select.POLLIN, left):
                        return None
                    try:
                        chunk = self._sock.recv(1 << 20)
                    except OSError as exc:
                        chunk, why = b"", exc
                    else:
                        why = "it exited"
                    if not chunk:
                        self._kill()
                        raise BackendUnavailable(f"store helper lost: {why}")
                    self._rbuf += chunk
                if (reply := Reply.unpack(body)).id == rid:
                    return reply
        except ValueError as exc:  # a malformed frame: this helper is not to be trusted
            self._kill()
            raise BackendUnavailable(f"store helper: {exc}") from None

    def _poll(self, event: int, timeout_s: float) -> bool:
        """Whether the socket is ready (poll, not select: an engine may hold over 1024 fds)."""
        p = select.poll()
        p.register(self._sock, event)
        return bool(p.poll(timeout_s * 1000))

    def _frame(self) -> bytes | None:
        if len(self._rbuf) < 4:
            return None
        n = frame_length(bytes(self._rbuf[:4]))
        if len(self._rbuf) < 4 + n:
            return None
        body = bytes(self._rbuf[4:4 + n])
        del self._rbuf[:4 + n]
        return body


def _arr(a) -> np.ndarray:
    return np.zeros(0, dtype=np.int64) if a is None else np.asarray(a, dtype=np.int64)
