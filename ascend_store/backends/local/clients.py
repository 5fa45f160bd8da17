"""Which client processes use a local pool, told by lock files beside its socket.

Each client holds an exclusive ``flock`` on ``<socket>.<owner>.client`` (``owner``: the id
it sends with every request) for as long as it is open. The kernel drops the lock when
the process exits, however it exits (SIGKILL included), so the pool tells a live client
from a gone one without trusting clocks or pids, across PID namespaces (containers that
share the socket's directory). The pool uses it twice: the memory of a lease or a
reservation past its TTL is reclaimed only once its client is gone (index.py), and a pool
with ``idle_exit_s`` exits that long after its last client went (server.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import time

log = logging.getLogger("ascend_store.pool")
SUFFIX = ".client"
OWNER_RE = re.compile(r"[0-9a-f]{16}")
SWEEP_S = 0.5  # how often the pool looks at its clients' files
FRESH_S = 2.0  # a file this young may not be locked yet: its client is between open and flock


def client_path(socket_path: str, owner: str) -> str:
    return f"{socket_path}.{owner}{SUFFIX}"


def start_lock(socket_path: str) -> int:
    """The lock file that elects one pool starter; a pool that decides to exit holds it
    until it has exited, so no engine adopts a pool that is going away."""
    return os.open(socket_path + ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


class ClientFile:
    """A client's side: its lock file, held while the client is open."""

    def __init__(self, socket_path: str, owner: str):
        self.path = client_path(socket_path, owner)
        self._fd: int | None = None

    def open(self) -> bool:
        """Create and lock the file (once); False when that is impossible, and the pool then
        treats this client as one it cannot check: its pins expire by TTL alone."""
        if self._fd is not None:
            return True
        try:
            # 0644 in the 0700 socket directory: the pool, possibly another user
            # (local.trusted_uid), must open it to test the lock.
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644)
        except OSError as exc:
            log.debug("no client file at %s (%s): the pool cannot tell when this client exits",
                      self.path, exc.strerror)
            return False
        try:
            for _ in range(100):  # a pool testing the lock holds it for microseconds
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.001)
            else:
                raise BlockingIOError
            # A pool that took the lock before us removed the file: ours would name nothing.
            if os.stat(self.path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError
        except OSError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


class Clients:
    """The pool's side: which owners are alive, and how many clients there are."""

    def __init__(self, socket_path: str, clock=time.monotonic):
        self.socket_path = socket_path
        self.dir, self._prefix = os.path.split(socket_path)
        self._prefix += "."
        self._clock = clock
        self._known: dict[str, tuple[bool, float]] = {}  # owner -> (alive, when checked)

    def alive(self, owner: str) -> bool:
        """Whether ``owner``'s process holds its lock (checked at most every SWEEP_S).
        Owners without a client file (older clients) are never alive: TTLs alone apply."""
        if not OWNER_RE.fullmatch(owner):
            return False
        now = self._clock()
        known = self._known.get(owner)
        if known is None or now - known[1] >= SWEEP_S:
            known = self._known[owner] = (_held(client_path(self.socket_path, owner)), now)
        return known[0]

    def sweep(self) -> int:
        """Check every client file beside the socket, removing those whose client is gone;
        return how many clients are alive."""
        now = self._clock()
        try:
            names = os.listdir(self.dir)
        except OSError:
            names = []
        live = 0
        for name in names:
            owner = name[len(self._prefix):-len(SUFFIX)]
            if name.startswith(self._prefix) and name.endswith(SUFFIX) and OWNER_RE.fullmatch(owner):
                alive = _held(os.path.join(self.dir, name))
                self._known[owner] = (alive, now)
                live += alive
        self._known = {o: k for o, k in self._known.items() if now - k[1] < SWEEP_S}
        return live


def _held(path: str) -> bool:
    """Whether some process holds the lock on ``path``; a file whose lock is free is
    removed (unless it is too young to be locked yet)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        if time.time() - st.st_ctime < FRESH_S:
            return True
        # Removed while we hold its lock, so a client that locks it later finds it gone.
        if os.stat(path, follow_symlinks=False).st_ino == st.st_ino:
            os.unlink(path)
        return False
    except OSError:
        return False
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False
