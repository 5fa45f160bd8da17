"""Whom the local pool client trusts, how the arena is backed, how long it lives.

Real pool processes and files throughout. "Another user" is uid 65534 (nobody): the
tests run as root, so they can hand files to it with chown, and run a pool as it with
setpriv (tests/e2e/test_pool_trust.py has the engine-level version of each squat).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading

import pytest
import zmq

from ascend_store.backends.base import BackendUnavailable
from ascend_store.backends.local import arena, protocol
from ascend_store.backends.local.client import LocalBackend
from ascend_store.backends.local.launcher import gc_arenas, ping
from ascend_store.backends.local.trust import UntrustedPool
from ascend_store.common.config import LocalPoolConfig
from tests.unit.test_local_pool import CAPACITY, Pool, _get, _put, _wait

OTHER_UID = 65534
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")


def _backend(path: str, start: str = "never", **kw) -> LocalBackend:
    return LocalBackend(LocalPoolConfig(socket=path, capacity=CAPACITY, start=start, **kw), timeout_s=1.0)


def _refused(path: str, match: str, start: str = "never", **kw) -> None:
    b = _backend(path, start, **kw)
    try:
        with pytest.raises(UntrustedPool, match=match):
            b.exists(["k"])
        with pytest.raises(UntrustedPool, match=match):
            b.buffer()
    finally:
        b.close()


# -- the socket and its directory --------------------------------------------------------

@root_only
def test_directory_squatted_by_another_user_is_refused_and_nothing_starts(sockdir):
    d = os.path.join(sockdir, "ascend-store-0")
    os.mkdir(d, 0o700)
    os.chown(d, OTHER_UID, OTHER_UID)
    path = os.path.join(d, "pool.sock")
    _refused(path, r"socket directory .* is owned by uid 65534", start="auto")
    assert os.listdir(d) == []  # no pool, lock or log was made inside it
    # Naming that uid as trusted is the way to use such a pool on purpose.
    with pytest.raises(BackendUnavailable, match="no pool at") as exc:
        _backend(path, trusted_uid=OTHER_UID).exists(["k"])
    assert not isinstance(exc.value, UntrustedPool)


def test_shared_directory_is_refused_and_a_readable_own_one_is_made_private(sockdir):
    shared = os.path.join(sockdir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    _refused(os.path.join(shared, "pool.sock"), r"mode 0777, open to group or others", start="auto")
    assert os.listdir(shared) == []
    readable = os.path.join(sockdir, "readable")
    os.mkdir(readable)
    os.chmod(readable, 0o755)
    b = _backend(os.path.join(readable, "pool.sock"), start="auto")
    try:
        _put(b, "own/k", b"v")
        assert _get(b, "own/k") == b"v"
        assert stat.S_IMODE(os.stat(readable).st_mode) == 0o700
    finally:
        b.close()


def test_symlinked_directory_and_open_parent_are_refused(sockdir):
    real = os.path.join(sockdir, "real")
    os.mkdir(real, 0o700)
    os.symlink(real, os.path.join(sockdir, "link"))
    _refused(os.path.join(sockdir, "link", "pool.sock"), r"is not a directory", start="auto")
    assert os.listdir(real) == []
    parent = os.path.join(sockdir, "open")
    os.makedirs(os.path.join(parent, "d"), 0o700)
    os.chmod(parent, 0o777)  # others could rename d away and put their own in its place
    _refused(os.path.join(parent, "d", "pool.sock"), r"writable by others without the sticky bit")


@root_only
def test_socket_of_another_user_is_refused_and_not_adopted(pool):
    os.chown(pool.socket, OTHER_UID, OTHER_UID)
    _refused(pool.socket, r"socket .* is owned by uid 65534", start="auto")
    assert ping(pool.socket)["pid"] == pool.pid  # ensure_pool neither adopted nor replaced it


def test_socket_open_to_others_is_refused(pool):
    os.chmod(pool.socket, 0o666)
    _refused(pool.socket, r"socket .* mode 0666")


# -- the arena the pool names ------------------------------------------------------------------

class FakePool:
    """Answers every request with one fixed reply (a pool that lies)."""

    def __init__(self, path: str, reply: dict | bytes):
        self.path = path
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"ipc://{path}")
        os.chmod(path, 0o600)
        self._reply = reply if isinstance(reply, bytes) else protocol.pack(reply)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if self._sock.poll(50):
                frames = self._sock.recv_multipart()
                self._sock.send_multipart(frames[:-1] + [self._reply])

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def _hello(arena_path, capacity):
    return {"ok": True, "epoch": "e1", "gone": 0, "added": 0, "arena": arena_path, "capacity": capacity,
            "found": [False]}


def _arena_file(directory, size, *, mode=0o600, backed=True, name=None):
    path = os.path.join(directory, name or arena.name("test", os.urandom(4).hex()))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    (os.posix_fallocate if backed else os.ftruncate)(fd, *((0, size) if backed else (size,)))
    os.close(fd)
    os.chmod(path, mode)
    return path


ARENA_CASES = {
    "not an arena name": (dict(name="secrets.txt"), CAPACITY, r"named .* as its arena"),
    "open to others": (dict(mode=0o644), CAPACITY, r"arena .* mode 0644"),
    "smaller than claimed": ({}, 2 * CAPACITY, r"less than the \d+ it claims"),
    "sparse": (dict(backed=False), CAPACITY, r"is not backed"),
    "foreign": (dict(), CAPACITY, r"arena .* owned by uid 65534"),
}


@pytest.mark.parametrize("case", list(ARENA_CASES))
def test_arena_named_by_a_pool_is_checked_before_it_is_mapped(sockdir, case):
    if case == "foreign" and os.getuid() != 0:
        pytest.skip("needs root to act as another user")
    kw, claimed, match = ARENA_CASES[case]
    path = _arena_file(sockdir, CAPACITY, **kw)
    if case == "foreign":
        os.chown(path, OTHER_UID, OTHER_UID)
    fake = FakePool(os.path.join(sockdir, "fake.sock"), _hello(path, claimed))
    b = _backend(fake.path)
    try:
        with pytest.raises(UntrustedPool, match=match):
            b.buffer()
        with pytest.raises(UntrustedPool, match=match):  # nor on the first data call
            b.exists(["k"]) and b.reserve(["k"], [1])
    finally:
        b.close()
        fake.close()


BAD_REPLIES = {
    "not msgpack": b"\xc1\xc1\xc1",
    "not a map": protocol.pack([1, 2, 3]),
    "no epoch": protocol.pack({"ok": True, "gone": 0, "found": [True]}),
    "huge array": protocol.pack({"ok": True, "epoch": "e", "gone": 0, "added": 0, "found": [True] * 70000}),
    "huge string": protocol.pack({"ok": True, "epoch": "e" * 10000, "gone": 0, "added": 0, "found": [True]}),
    "wrong length": protocol.pack({"ok": True, "epoch": "e", "gone": 0, "added": 0, "found": [True, True]}),
    "no gone count": protocol.pack({"ok": True, "epoch": "e", "added": 0, "found": [True]}),
    "no added count": protocol.pack({"ok": True, "epoch": "e", "gone": 0, "found": [True]}),
    "too large": b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1),
}


@pytest.mark.parametrize("case", list(BAD_REPLIES))
def test_replies_are_bounded_and_checked(sockdir, case):
    fake = FakePool(os.path.join(sockdir, "fake.sock"), BAD_REPLIES[case])
    b = _backend(fake.path)
    try:
        with pytest.raises(BackendUnavailable):
            b.exists(["k"])
    finally:
        b.close()
        fake.close()


# -- arena backing -------------------------------------------------------------------------------

def test_arena_is_fully_backed_and_locked(pool):
    path = ping(pool.socket)["arena"]
    st = os.stat(path)
    assert arena.is_arena(path) and st.st_blocks * 512 >= CAPACITY  # allocated, not sparse
    assert gc_arenas(os.path.dirname(path)) == [] and os.path.exists(path)  # its lock says alive


# The pool in a private mount namespace where /dev/shm and the socket's directory are small
# tmpfs: the old sparse arena started there, and the first write past 1 MiB was SIGBUS.
SMALL_TMPFS = ("mount -t tmpfs -o size=1m,mode=1777 tmpfs /dev/shm && "
               "mount -t tmpfs -o size=1m,mode=700 tmpfs {d}")
STARTER = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    from ascend_store.backends.local.client import LocalBackend
    from ascend_store.common.config import LocalPoolConfig
    cfg = LocalPoolConfig(socket=sys.argv[1], capacity=64 << 20, start="auto")
    clients = [LocalBackend(cfg, timeout_s=1.0) for _ in range(2)]  # a scheduler and a worker
    for c in clients:
        try:
            c.exists(["k"])
        except Exception as exc:
            print("CALL", type(exc).__name__, exc)
""")


def _in_small_tmpfs(d: str, *cmd: str) -> subprocess.CompletedProcess:
    os.makedirs(d, 0o700, exist_ok=True)
    script = SMALL_TMPFS.format(d=d) + ' && exec "$@"'
    return subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", *cmd], capture_output=True, text=True,
                          timeout=60)


@root_only
def test_arena_that_cannot_be_backed_fails_the_start_with_a_clear_error(sockdir):
    d = os.path.join(sockdir, "small")
    r = _in_small_tmpfs(d, sys.executable, "-m", "ascend_store.ops.cli", "pool", "serve",
                        "--socket", os.path.join(d, "pool.sock"), "--capacity", "64MiB")
    assert r.returncode == 2, r.stderr
    assert "pool not started: the pool's arena of 67108864 bytes does not fit in" in r.stderr
    # An engine's embedded start: its log names the cause once, and calls fail cleanly.
    r = _in_small_tmpfs(d, sys.executable, "-c", STARTER, os.path.join(d, "pool.sock"))
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("could not start a pool at") == 1, r.stderr
    assert r.stderr.count("does not fit in") == 1 and "(it exited)" in r.stderr
    assert r.stdout.count("CALL BackendUnavailable no pool at") == 2


# -- arena lifetime ------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signals_remove_the_arena(sockdir, sig):
    p = Pool(os.path.join(sockdir, "pool.sock")).start()
    path = ping(p.socket)["arena"]
    os.kill(p.pid, sig)
    assert p.proc.wait(10) == 0
    assert not os.path.exists(path) and not os.path.exists(p.socket)


def test_killed_pools_arena_is_collected_by_the_next_start_and_by_gc(sockdir):
    a = Pool(os.path.join(sockdir, "a.sock")).start()
    b = Pool(os.path.join(sockdir, "b.sock")).start()
    arena_a, arena_b = ping(a.socket)["arena"], ping(b.socket)["arena"]
    a.kill()
    b.kill()
    assert os.path.exists(arena_a) and os.path.exists(arena_b)  # SIGKILL: the pool saw nothing
    live = Pool(os.path.join(sockdir, "c.sock")).start()  # another socket: another tag
    try:
        assert not os.path.exists(arena_a) and not os.path.exists(arena_b)
        b.start()
        arena_b = ping(b.socket)["arena"]
        b.kill()
        assert gc_arenas(os.path.dirname(arena_b)) == [arena_b]
        assert os.path.exists(ping(live.socket)["arena"])  # a live pool's arena is kept
    finally:
        live.stop()


def test_gc_leaves_other_files_alone(sockdir):
    keep = [_arena_file(sockdir, 4096, name="ascend-store-old-format"),  # no lock protocol: unknown
            os.path.join(sockdir, "other.arena")]
    open(keep[1], "w").close()
    os.mkfifo(os.path.join(sockdir, arena.name("fifo", "x")))
    dead = _arena_file(sockdir, 4096)
    assert gc_arenas(sockdir) == [dead]
    assert all(os.path.exists(k) for k in keep)
    if os.getuid() == 0:  # another user's dead arena is theirs to collect
        other = _arena_file(sockdir, 4096)
        os.chown(other, OTHER_UID, OTHER_UID)
        assert gc_arenas(sockdir) == [] and os.path.exists(other)


def test_the_last_clients_death_removes_the_arena(sockdir):
    path = os.path.join(sockdir, "pool.sock")
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys
        from ascend_store.backends.local.client import LocalBackend
        from ascend_store.backends.local.launcher import ping
        from ascend_store.common.config import LocalPoolConfig
        LocalBackend(LocalPoolConfig(socket=sys.argv[1], capacity=1 << 20, idle_exit_s=0.5))
        print(ping(sys.argv[1])["arena"], flush=True)
        sys.stdin.readline()
    """), path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    arena_path = parent.stdout.readline().strip()
    assert os.path.exists(arena_path)
    parent.kill()  # SIGKILL: only the pool's watch on its clients' lock files can notice
    parent.wait(10)
    _wait(lambda: not os.path.exists(arena_path), 10, "the orphaned pool to remove its arena")
