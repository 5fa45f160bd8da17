"""The embedded local pool, end to end: real pool processes, real sockets, real shared memory."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from ascend_store.backends.base import BackendUnavailable, Status
from ascend_store.backends.guard import GuardedBackend
from ascend_store.backends.local import protocol
from ascend_store.backends.local.client import LocalBackend
from ascend_store.backends.local.clients import alive
from ascend_store.backends.local.launcher import ensure_pool, ping
from ascend_store.common.config import LocalPoolConfig

CAPACITY = 4 * 2**20
KiB = 2**10


def _wait(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


_running = alive  # not a zombie either: an orphaned pool may wait unreaped for a while


def _reap_orphan(pid: int) -> None:
    """Kill a pool we started indirectly if it outlived the test (a failing test must not leak it)."""
    if _running(pid):
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
        time.sleep(0.3)
        if _running(pid):
            os.kill(pid, signal.SIGKILL)


class Pool:
    """A standalone pool process (``ascend-store pool serve``) on a private socket."""

    def __init__(self, socket_path: str, capacity: str = "4MiB", extra: tuple[str, ...] = ()):
        self.socket = socket_path
        self.capacity = capacity
        self.extra = extra  # more `pool serve` flags
        self.proc: subprocess.Popen | None = None

    def start(self) -> Pool:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ascend_store.ops.cli", "pool", "serve", "--socket", self.socket,
             "--capacity", self.capacity, *self.extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not ping(self.socket):
            assert self.proc.poll() is None, f"pool exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "pool did not answer"
            time.sleep(0.02)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        self.proc = None

    def cfg(self, **over) -> LocalPoolConfig:
        return LocalPoolConfig(**{"socket": self.socket, "capacity": CAPACITY, "start": "never", **over})

    def client(self, timeout_s: float = 1.0, **kw) -> LocalBackend:
        return LocalBackend(self.cfg(), timeout_s=timeout_s, **kw)


@pytest.fixture
def client(pool):
    c = pool.client()
    yield c
    c.close()


def _pattern(tag: int, size: int) -> bytes:
    return random.Random(tag).randbytes(size)


def _put(b: LocalBackend, key: str, data: bytes) -> int:
    _, view = b.buffer()
    [slot] = b.reserve([key], [len(data)])
    assert slot.status is Status.OK, (key, slot)
    view[slot.offset:slot.offset + len(data)] = data
    assert b.commit([key]) == [Status.OK]
    return slot.offset


def _get(b: LocalBackend, key: str) -> bytes | None:
    _, view = b.buffer()
    [slot] = b.lease([key])
    if slot.status is Status.MISSING:
        return None
    assert slot.status is Status.OK
    try:
        return bytes(view[slot.offset:slot.offset + slot.size])
    finally:
        b.release([key])


# -- basic operation ---------------------------------------------------------------------

def test_round_trip_through_shared_memory(pool, client):
    epoch, view = client.buffer()
    assert len(view) == CAPACITY
    assert epoch == ping(pool.socket)["epoch"]
    data = {"ns/g0/tp0of1/L0/aa": _pattern(1, 1000), "ns/g0/tp0of1/L1/aa": _pattern(2, 5000)}
    keys = list(data)
    slots = client.reserve(keys, [len(v) for v in data.values()])
    assert [s.status for s in slots] == [Status.OK, Status.OK]
    assert [s.size for s in slots] == [1000, 5000]
    spans = sorted((s.offset, s.offset + s.size) for s in slots)
    assert spans[0][1] <= spans[1][0]
    for s, v in zip(slots, data.values()):
        view[s.offset:s.offset + s.size] = v
    assert client.exists(keys) == [False, False]  # not committed yet
    # The writer itself may re-reserve its uncommitted object (same slot back).
    assert client.reserve(keys[:1], [1000])[0] == slots[0]
    assert client.commit(keys + ["missing"]) == [Status.OK, Status.OK, Status.MISSING]
    assert client.exists(keys + ["missing"]) == [True, True, False]

    # A second client maps the arena on its own and reads the same bytes.
    other = pool.client()
    try:
        leased = other.lease(keys + ["missing"])
        assert [s.status for s in leased] == [Status.OK, Status.OK, Status.MISSING]
        _, oview = other.buffer()
        for s, v in zip(leased, data.values()):
            assert s.size == len(v)
            assert bytes(oview[s.offset:s.offset + s.size]) == v
        assert client.remove(keys[:1]) == [Status.BUSY]
        assert client.stats()["leases"] == 2
        other.release(keys)
    finally:
        other.close()
    assert client.remove(keys + ["missing"]) == [Status.OK, Status.OK, Status.MISSING]
    assert client.exists(keys) == [False, False]
    st = client.stats()
    assert st["objects"] == 0 and st["used_bytes"] == 0 and st["capacity"] == CAPACITY


def test_abort_frees_reservation(client):
    [slot] = client.reserve(["k/abort"], [100 * KiB])
    assert slot.status is Status.OK
    assert client.stats()["reserved"] == 1
    client.abort(["k/abort"])
    st = client.stats()
    assert st["reserved"] == 0 and st["used_bytes"] == 0
    assert client.commit(["k/abort"]) == [Status.MISSING]


def test_empty_calls_do_not_touch_the_socket(client):
    before = client.rpcs
    assert client.exists([]) == [] and client.reserve([], []) == [] and client.lease([]) == []
    assert client.commit([]) == [] and client.remove([]) == []
    client.abort([])
    client.release([])
    assert client.rpcs == before


def test_list(client):
    _put(client, "ns1/a", b"x" * 10)
    _put(client, "ns2/b", b"y" * 20)
    client.reserve(["ns1/c"], [30])
    entries = sorted(map(tuple, client.list("ns1/")))
    assert entries == [("ns1/a", 10, True, 0), ("ns1/c", 30, False, 0)]


def test_socket_and_arena_are_private(pool):
    assert stat.S_IMODE(os.stat(pool.socket).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(pool.socket).st_mode)
    assert stat.S_IMODE(os.stat(os.path.dirname(pool.socket)).st_mode) == 0o700
    arena = ping(pool.socket)["arena"]
    st = os.stat(arena)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()
    assert st.st_size == CAPACITY


def test_clean_stop_removes_socket_and_arena(pool):
    arena = ping(pool.socket)["arena"]
    pool.stop()
    assert not os.path.exists(pool.socket)
    assert not os.path.exists(arena)


# -- several clients at once ---------------------------------------------------------------

N_PROCS, N_OBJS, OBJ_SIZE = 4, 20, 8 * KiB


def _client_proc(socket_path: str, rank: int, barrier, results) -> None:
    try:
        b = LocalBackend(LocalPoolConfig(socket=socket_path, capacity=CAPACITY, start="never"),
                         timeout_s=5.0)
        for i in range(N_OBJS):
            _put(b, f"p{rank}/o{i}", _pattern(rank * 1000 + i, OBJ_SIZE))
        barrier.wait(60)
        verified, bad = 0, []
        for r in range(N_PROCS):
            for i in range(N_OBJS):
                got = _get(b, f"p{r}/o{i}")
                if got == _pattern(r * 1000 + i, OBJ_SIZE):
                    verified += 1
                else:
                    bad.append((r, i, None if got is None else len(got)))
        b.close()
        results.put((rank, verified, bad[:5]))
    except Exception as exc:  # noqa: BLE001 - report, never hang the parent
        results.put((rank, -1, repr(exc)))


def test_concurrent_client_processes(pool):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(N_PROCS)
    results = ctx.Queue()
    procs = [ctx.Process(target=_client_proc, args=(pool.socket, r, barrier, results))
             for r in range(N_PROCS)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert sorted(r for r, _, _ in got) == list(range(N_PROCS))
    for rank, verified, bad in got:
        assert verified == N_PROCS * N_OBJS, (rank, bad)
    stats_client = LocalBackend(pool.cfg(), timeout_s=1.0, map_arena=False)
    st = stats_client.stats()
    stats_client.close()
    assert st["objects"] == N_PROCS * N_OBJS
    assert st["leases"] == 0
    assert st["evictions"] == 0


# -- eviction --------------------------------------------------------------------------------

def test_eviction_at_capacity(client):
    size = 256 * KiB
    n = 24  # 6 MiB through a 4 MiB pool
    for i in range(n):
        _put(client, f"ev/{i:02d}", _pattern(i, size))
    found = client.exists([f"ev/{i:02d}" for i in range(n)])
    fit = CAPACITY // size
    assert found == [False] * (n - fit) + [True] * fit  # oldest gone first
    st = client.stats()
    assert st["evictions"] >= n - fit
    assert st["used_bytes"] <= CAPACITY
    for i in range(n - fit, n):  # survivors were not overwritten by later objects
        assert _get(client, f"ev/{i:02d}") == _pattern(i, size)


def test_leased_object_survives_pressure_and_full_pool_says_no_space(pool, client):
    size = 1 * 2**20
    _put(client, "pin/0", _pattern(0, size))
    [slot] = client.lease(["pin/0"])
    for i in range(1, 8):
        _put(client, f"fill/{i}", _pattern(i, size))
    assert client.exists(["pin/0"]) == [True]
    _, view = client.buffer()
    assert bytes(view[slot.offset:slot.offset + size]) == _pattern(0, size)
    # An object larger than the pool can never be placed.
    assert client.reserve(["huge"], [CAPACITY + 1])[0].status is Status.NO_SPACE
    assert client.exists(["pin/0"]) == [True]
    client.release(["pin/0"])


# -- malformed input -------------------------------------------------------------------------

BAD_MESSAGES = {
    "garbage": b"\xc1\xff\x00not msgpack at all",
    "truncated": protocol.pack({"op": "exists", "keys": ["a"]})[:-2],
    "list": protocol.pack(["hello"]),
    "int": protocol.pack(5),
    "no_op": protocol.pack({"keys": ["a"]}),
    "unknown_op": protocol.pack({"op": "drop_everything"}),
    "op_not_str": protocol.pack({"op": 1}),
    "space_in_key": protocol.pack({"op": "exists", "keys": ["a b"]}),
    "long_key": protocol.pack({"op": "exists", "keys": ["k" * 300]}),
    "empty_key": protocol.pack({"op": "exists", "keys": [""]}),
    "nul_in_key": protocol.pack({"op": "exists", "keys": ["a\x00b"]}),
    "non_ascii_key": protocol.pack({"op": "exists", "keys": ["ключ"]}),
    "key_not_str": protocol.pack({"op": "exists", "keys": [7]}),
    "keys_not_list": protocol.pack({"op": "exists", "keys": "abc"}),
    "binary_key": protocol.pack({"op": "exists", "keys": [b"abc"]}),
    "negative_size": protocol.pack({"op": "reserve", "keys": ["k"], "sizes": [-1]}),
    "zero_size": protocol.pack({"op": "reserve", "keys": ["k"], "sizes": [0]}),
    "bool_size": protocol.pack({"op": "reserve", "keys": ["k"], "sizes": [True]}),
    "float_size": protocol.pack({"op": "reserve", "keys": ["k"], "sizes": [1.5]}),
    "mismatched_sizes": protocol.pack({"op": "reserve", "keys": ["a", "b"], "sizes": [10]}),
    "reserve_without_sizes": protocol.pack({"op": "reserve", "keys": ["a"]}),
    "bad_prefix": protocol.pack({"op": "list", "prefix": 5}),
    "long_prefix": protocol.pack({"op": "list", "prefix": "p" * 300}),
    "int_map_key": msgpack.packb({"op": "hello", 1: 2}),
    "big_map": protocol.pack({"op": "hello", **{f"f{i}": i for i in range(40)}}),
    "too_many_keys": protocol.pack({"op": "exists", "keys": ["k"] * 70000}),
    "deep": b"\x91" * 5000 + b"\xc0",
}


def _rpc(sock: zmq.Socket, payload: bytes, tag: bytes, wait_s: float = 2.0):
    sock.send_multipart([tag, payload])
    if not sock.poll(int(wait_s * 1000)):
        return None
    frames = sock.recv_multipart()
    assert frames[0] == tag
    return msgpack.unpackb(frames[-1], raw=False)


@pytest.fixture
def raw(pool):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"ipc://{pool.socket}")
    yield s
    s.close(0)
    ctx.term()


def test_malformed_messages_get_error_replies(pool, client, raw):
    before = client.stats()["rejected"]
    errors = 0
    for i, (name, payload) in enumerate(BAD_MESSAGES.items()):
        reply = _rpc(raw, payload, i.to_bytes(4, "little"))
        assert reply is not None, f"{name}: no reply"
        assert reply["ok"] is False, f"{name}: accepted: {reply}"
        assert isinstance(reply.get("error"), str) and reply["error"], name
        errors += 1
    assert ping(pool.socket) is not None
    st = client.stats()
    assert st["rejected"] - before == errors
    assert st["objects"] == 0 and st["reserved"] == 0  # nothing was half-applied
    # Normal traffic still works on the same connection and through a client.
    reply = _rpc(raw, protocol.pack({"op": "exists", "keys": ["ok/key"]}), b"good")
    assert reply["ok"] is True and reply["found"] == [False]
    _put(client, "after/bad", b"payload")
    assert _get(client, "after/bad") == b"payload"


def test_dotted_key_is_an_opaque_key(pool, client, raw):
    # KEY_RE admits '.' and '/' (keys are "ns/g0/tp0of1/L3/<hash>"), so "../x" is a valid
    # key. The local pool never turns keys into paths, so it is stored like any other.
    before = client.stats()["rejected"]
    outside = os.path.join(os.path.dirname(pool.socket), "..", "x")
    existed = os.path.exists(outside)
    reply = _rpc(raw, protocol.pack({"op": "exists", "keys": ["../x"]}), b"dots")
    assert reply["ok"] is True and reply["found"] == [False]
    _put(client, "../x", b"dots")
    assert _get(client, "../x") == b"dots"
    assert client.stats()["rejected"] == before
    assert os.path.exists(outside) == existed


def test_key_with_trailing_newline_is_rejected(pool, raw):
    reply = _rpc(raw, protocol.pack({"op": "exists", "keys": ["abc\n"]}), b"nl")
    assert reply["ok"] is False


def test_oversized_message_is_dropped(pool, client, raw):
    before = client.stats()
    reply = _rpc(raw, b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1), b"big", wait_s=1.0)
    assert reply is None or reply["ok"] is False
    assert ping(pool.socket) is not None
    _put(client, "after/big", b"still fine")
    assert _get(client, "after/big") == b"still fine"
    after = client.stats()
    assert after["pid"] == before["pid"] and after["epoch"] == before["epoch"]


def test_out_of_bounds_slot_from_server_is_refused(sockdir):
    """A reply naming memory outside the arena never becomes a slot."""
    path = os.path.join(sockdir, "fake.sock")
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{path}")
    os.chmod(path, 0o600)
    arena = os.path.join(sockdir, "ascend-store-test.arena")  # a real, private, backed arena
    fd = os.open(arena, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, CAPACITY)
    os.close(fd)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if router.poll(50):
                frames = router.recv_multipart()
                packed = lambda v: np.asarray([v], dtype="<i8").tobytes()  # noqa: E731
                reply = {"ok": True, "epoch": "e1", "gone": 0, "added": 0, "status": packed(0),
                         "offsets": packed(CAPACITY - 10), "sizes": packed(100), "arena": arena,
                         "capacity": CAPACITY}
                router.send_multipart(frames[:-1] + [protocol.pack(reply)])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    b = LocalBackend(LocalPoolConfig(socket=path, capacity=CAPACITY, start="never"), timeout_s=1.0,
                     map_arena=False)
    try:
        with pytest.raises(BackendUnavailable, match="out-of-bounds"):
            b.lease(["k"])
        with pytest.raises(BackendUnavailable, match="out-of-bounds"):
            b.reserve(["k"], [100])
    finally:
        b.close()
        stop.set()
        t.join(5)
        router.close(0)
        ctx.term()


# -- failures ------------------------------------------------------------------------------

def test_absent_pool_fails_immediately(sockdir):
    b = LocalBackend(LocalPoolConfig(socket=os.path.join(sockdir, "none.sock"), start="never"),
                     timeout_s=5.0)
    try:
        for call in (lambda: b.exists(["k"]), b.buffer, b.stats, lambda: b.reserve(["k"], [1])):
            t = time.monotonic()
            with pytest.raises(BackendUnavailable):
                call()
            assert time.monotonic() - t < 0.5
    finally:
        b.close()


def test_stopped_pool_times_out(pool, client):
    _put(client, "before/stop", b"abc")
    os.kill(pool.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(BackendUnavailable, match="timed out"):
            client.exists(["before/stop"])
        elapsed = time.monotonic() - t
        assert 0.9 <= elapsed < 3.0
    finally:
        os.kill(pool.pid, signal.SIGCONT)
    assert client.exists(["before/stop"]) == [True]
    assert _get(client, "before/stop") == b"abc"


def test_restarted_pool_gets_a_new_epoch(pool, client):
    epoch1, _ = client.buffer()
    arena1 = ping(pool.socket)["arena"]
    _put(client, "old/key", b"old")
    pool.kill()  # a crash: socket and arena files are left behind
    assert os.path.exists(arena1)
    pool.start()
    assert not os.path.exists(arena1)  # the new pool cleared the crashed one's arena
    assert client.exists(["old/key"]) == [False]
    epoch2, _ = client.buffer()
    assert epoch2 != epoch1
    assert epoch2 == ping(pool.socket)["epoch"]
    # The client mapped the new arena: bytes written through it reach other clients.
    _put(client, "new/key", b"new bytes")
    other = pool.client()
    try:
        assert _get(other, "new/key") == b"new bytes"
    finally:
        other.close()


def test_restart_with_larger_arena_remaps_before_handing_out_slots(pool, client):
    client.buffer()
    pool.stop()
    pool.capacity = "8MiB"
    pool.start()
    # The first call after the restart already returns slots in the new, larger arena.
    size = 6 * 2**20
    [slot] = client.reserve(["big/after/restart"], [size])
    assert slot.status is Status.OK
    _, view = client.buffer()
    assert len(view) == 8 * 2**20
    data = _pattern(9, size)
    view[slot.offset:slot.offset + size] = data
    assert client.commit(["big/after/restart"]) == [Status.OK]
    other = pool.client()
    try:
        assert _get(other, "big/after/restart") == data
    finally:
        other.close()


def test_guard_backs_off_after_failure(pool):
    inner = pool.client(timeout_s=1.0)
    guard = GuardedBackend(inner, "test pool", first_backoff_s=0.5)
    try:
        assert guard.exists(["k"]) == [False]
        os.kill(pool.pid, signal.SIGSTOP)
        try:
            t = time.monotonic()
            with pytest.raises(BackendUnavailable, match="timed out"):
                guard.exists(["k"])
            assert time.monotonic() - t >= 0.9
            rpcs = inner.rpcs
            t = time.monotonic()
            with pytest.raises(BackendUnavailable, match="backing off"):
                guard.exists(["k"])
            with pytest.raises(BackendUnavailable, match="backing off"):
                guard.stats()
            assert time.monotonic() - t < 0.1
            assert inner.rpcs == rpcs  # the pool was not even asked
            assert guard.failures == 1
        finally:
            os.kill(pool.pid, signal.SIGCONT)
        time.sleep(0.6)
        assert guard.exists(["k"]) == [False]  # probes again after the backoff
        assert guard.exists(["k"]) == [False]
        assert guard.timeout_s == 1.0  # other attributes pass through
    finally:
        guard.close()


def test_guard_closes_only_on_a_call_the_pool_answered(pool):
    """A call that never reaches the pool (no keys) must not end an outage: the next real
    call after the backoff still counts as the probe, and a failure doubles the backoff."""
    inner = pool.client(timeout_s=0.5)
    guard = GuardedBackend(inner, "test pool answered", first_backoff_s=0.2)
    try:
        os.kill(pool.pid, signal.SIGSTOP)
        try:
            with pytest.raises(BackendUnavailable):
                guard.exists(["k"])
            time.sleep(0.25)
            assert guard.exists([]) == [] and guard.abort([]) is None  # asked nobody
            with pytest.raises(BackendUnavailable):
                guard.exists(["k"])
            assert guard._backoff == 0.4  # still the same outage: doubled, not restarted
        finally:
            os.kill(pool.pid, signal.SIGCONT)
        time.sleep(0.45)
        assert guard.exists(["k"]) == [False]
        assert guard._backoff == 0.0
    finally:
        guard.close()


def test_guard_backoff_doubles_caps_and_resets(sockdir):
    path = os.path.join(sockdir, "p.sock")
    inner = LocalBackend(LocalPoolConfig(socket=path, start="never"), timeout_s=1.0)
    guard = GuardedBackend(inner, "test pool", first_backoff_s=0.3, max_backoff_s=0.6)

    def attempt():
        try:
            guard.exists(["k"])
        except BackendUnavailable as exc:
            return "backoff" if "backing off" in str(exc) else "tried"
        return "ok"

    try:
        assert attempt() == "tried"  # no pool: fails at once, backoff 0.3
        assert attempt() == "backoff"
        time.sleep(0.35)
        assert attempt() == "tried"  # second failure: backoff 0.6
        time.sleep(0.35)
        assert attempt() == "backoff"
        time.sleep(0.3)
        assert attempt() == "tried"  # third failure: 1.2 capped at 0.6
        time.sleep(0.65)
        assert attempt() == "tried"
        assert guard.failures == 4
        pool = Pool(path).start()
        try:
            time.sleep(0.65)
            assert attempt() == "ok"
            pool.stop()
            assert attempt() == "tried"  # times out on the old connection
            assert attempt() == "backoff"
            time.sleep(0.35)
            assert attempt() == "tried"  # the success reset the backoff to 0.3
        finally:
            pool.stop()
    finally:
        guard.close()


# -- command line ------------------------------------------------------------------------------

def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ascend_store.ops.cli", "pool", *args],
                          capture_output=True, text=True, timeout=30, check=False)


def test_cli_status_and_inspect(pool, client):
    _put(client, "cli/a", b"12345")
    out = _cli("status", "--socket", pool.socket)
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["capacity"] == CAPACITY
    assert st["objects"] == 1 and st["pid"] == pool.pid
    out = _cli("inspect", "--socket", pool.socket, "--prefix", "cli/")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [{"key": "cli/a", "bytes": 5, "ready": True, "leases": 0}]


def test_cli_status_without_pool(sockdir):
    out = _cli("status", "--socket", os.path.join(sockdir, "none.sock"))
    assert out.returncode == 1
    assert "no pool" in out.stderr
    assert out.stdout == ""


def test_cli_serve_rejects_bad_capacity(sockdir):
    out = _cli("serve", "--socket", os.path.join(sockdir, "p.sock"), "--capacity", "lots")
    assert out.returncode == 2
    assert "--capacity" in out.stderr


# -- auto start ----------------------------------------------------------------------------------

PARENT = textwrap.dedent("""
    import sys
    from ascend_store.backends.local.client import LocalBackend
    from ascend_store.backends.local.launcher import ping
    from ascend_store.common.config import LocalPoolConfig
    cfg = LocalPoolConfig(socket=sys.argv[1], capacity=1 << 20, start="auto", idle_exit_s=0.5)
    client = LocalBackend(cfg)  # starts the pool (ensure_pool) unless one answers
    print(client.started or 0, ping(cfg.socket)["pid"], flush=True)
    sys.stdin.readline()  # live until the test says so
""")


def _parent(socket_path):
    return subprocess.Popen([sys.executable, "-c", PARENT, socket_path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def test_ensure_pool_starts_a_pool_that_goes_after_its_last_client(sockdir):
    path = os.path.join(sockdir, "auto", "pool.sock")  # the directory does not exist yet
    parent = _parent(path)
    try:
        started, answering = map(int, parent.stdout.readline().split())
        assert started and started == answering
        assert ping(path)["capacity"] == 1 << 20
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    finally:
        parent.stdin.close()
        parent.wait(10)
    try:  # its only client is gone: it exits 0.5 s later (idle_exit_s)
        _wait(lambda: ping(path) is None, 5, "the orphaned pool to stop")
        _wait(lambda: not _running(started), 5, "the pool process to exit")
    finally:
        _reap_orphan(started)
    assert not os.path.exists(path)


def test_concurrent_ensure_pool_agree_on_one_pool(sockdir):
    path = os.path.join(sockdir, "pool.sock")
    parents = [_parent(path) for _ in range(2)]
    try:
        lines = [tuple(map(int, p.stdout.readline().split())) for p in parents]
        started = [s for s, _ in lines if s]
        assert len(started) == 1, lines  # exactly one of them started a pool
        assert {a for _, a in lines} == set(started)  # and both talk to it
    finally:
        for p in parents:
            p.stdin.close()
            p.wait(10)
    try:
        _wait(lambda: not _running(started[0]), 5, "the pool process to exit")
    finally:
        _reap_orphan(started[0])


def test_ensure_pool_reuses_a_running_pool(pool):
    assert ensure_pool(pool.cfg(start="auto")) is None
    assert ping(pool.socket)["pid"] == pool.pid


def test_backend_with_auto_start_leaves_its_pool_when_closed(sockdir):
    path = os.path.join(sockdir, "pool.sock")
    b = LocalBackend(LocalPoolConfig(socket=path, capacity=1 << 20, start="auto", idle_exit_s=0.5),
                     timeout_s=2.0)
    try:
        pid = ping(path)["pid"]
        assert _running(pid)
        _put(b, "auto/k", b"auto")
        assert _get(b, "auto/k") == b"auto"
        assert b.stats()["capacity"] == 1 << 20
        assert b.stats()["clients"] == 1
    finally:
        b.close()
    try:  # closing does not stop it; having no client for idle_exit_s does
        _wait(lambda: not _running(pid), 5, "the pool to exit")
    finally:
        _reap_orphan(pid)
    assert ping(path) is None
