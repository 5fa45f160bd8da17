"""Who holds the local pool's memory, and for how long: real pool processes, real clients.

A lease or a reservation past its TTL is reclaimed only once its client process is gone,
so a slow reader or writer never shares bytes with another object, even with
``verify_checksum: false`` (nothing else would notice). A pool started by an engine
(``start: auto``) serves as long as any client process lives, whichever started it, and
exits ``idle_exit_s`` after the last one is gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ascend_store.backends.base import BackendUnavailable, Status
from ascend_store.backends.local.client import LocalBackend
from ascend_store.backends.local.launcher import ping
from ascend_store.common.config import LocalPoolConfig
from ascend_store.common.metadata import ChunkLoad, StepMetadata
from ascend_store.worker import host_loads
from tests.unit.test_load_queue import _worker_with_two_saved_chunks
from tests.unit.test_local_pool import KiB, Pool, _get, _pattern, _put, _reap_orphan, _running, _wait

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

TTL_S = 0.2
BLOCK, CHUNK_BLOCKS = 16, 256 // 16
# A real pool server whose reservations, too, expire after TTL_S (the CLI keeps them 60 s).
SHORT_TTLS = textwrap.dedent(f"""
    import signal, sys
    from ascend_store.backends.local.server import PoolServer
    server = PoolServer(sys.argv[1], 1 << 20, lease_ttl_s={TTL_S})
    server.index.reserve_ttl_s = {TTL_S}
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.stop)
    server.serve_forever()
""")


class ShortTtlPool(Pool):
    def start(self) -> Pool:
        self.proc = subprocess.Popen([sys.executable, "-c", SHORT_TTLS, self.socket],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        _wait(lambda: ping(self.socket), 20, "the pool to start")
        return self


def _past_ttl() -> None:
    time.sleep(3 * TTL_S + 0.3)  # past the TTL and the pool's next reap (every 0.1 s)


def _fill(client: LocalBackend, total: int, size: int) -> list[str]:
    """Write ``total`` bytes of objects of ``size`` bytes (the pool evicts what it may)."""
    keys = [f"filler/{i}" for i in range(total // size)]
    for i, key in enumerate(keys):
        _put(client, key, _pattern(100 + i, size))
    return keys


def _damaged(client: LocalBackend, keys: list[str], size: int) -> tuple[int, list[str]]:
    """How many of ``keys`` are still stored, and those whose bytes changed."""
    got = {k: _get(client, k) for k in keys}
    kept = {k: v for k, v in got.items() if v is not None}
    return len(kept), [k for k, v in kept.items() if v != _pattern(100 + keys.index(k), size)]


def test_a_slow_reader_past_its_lease_ttl_loads_its_own_bytes(sockdir, monkeypatch):
    """The worker leases two chunk objects, then its copy stalls past the lease TTL while
    another client fills the pool. Before, the pool dropped the lease and evicted the
    objects; the filler's bytes landed in their place and the load copied them into the KV
    cache, reporting no error (``verify_checksum: false``; the headers were checked before
    the stall). Now the live reader's objects stay pinned: the filler gets NO_SPACE."""
    pool = Pool(os.path.join(sockdir, "pool.sock"), extra=("--lease-ttl", str(TTL_S))).start()
    filler = pool.client()
    try:
        worker, caches, src, dst, chunks = _worker_with_two_saved_chunks(pool, copy_path="per_block",
                                                                         verify_checksum=False)

        leased, go = threading.Event(), threading.Event()
        for name in ("copy_layer", "decode_layer"):
            real = getattr(host_loads, name)

            def stalled(*args, _real=real, **kwargs):
                leased.set()
                assert go.wait(30)
                return _real(*args, **kwargs)

            monkeypatch.setattr(host_loads, name, stalled)
        load = StepMetadata(loads=[ChunkLoad("r", 0, f"{c:032x}", b) for c, b in enumerate(chunks(dst))],
                            new_tokens=1)
        worker.start_load_kv(load)
        assert leased.wait(30)
        _past_ttl()
        filled = _fill(filler, 4 * 2**20, 64 * KiB)
        overdue = filler.stats().get("overdue_leases")
        go.set()
        for name in worker.order:
            worker.wait_for_layer_load(name)
        assert worker.get_block_ids_with_load_errors() == set()
        for name, cache in caches.items():
            assert torch.equal(cache[:, dst], cache[:, src]), name
        kept, damaged = _damaged(filler, filled, 64 * KiB)
        assert kept and not damaged
        assert overdue == 2  # the two chunk objects were held past their TTL
        worker.shutdown()
    finally:
        filler.close()
        pool.stop()


def test_a_slow_writer_past_its_reservation_never_writes_into_another_object(sockdir):
    """A writer reserves, then stalls past the reservation TTL while another client fills
    the pool. Before, the pool freed the reservation and gave its memory to the filler's
    objects; the writer's late bytes overwrote them, undetected. Now the reservation of a
    live writer stays: the filler gets the rest of the pool, the writer commits."""
    pool = ShortTtlPool(os.path.join(sockdir, "pool.sock")).start()
    writer, filler = pool.client(), pool.client()
    try:
        size = 512 * KiB
        [slot] = writer.reserve(["writer/a"], [size])
        assert slot.status is Status.OK
        _past_ttl()
        filled = _fill(filler, 2**20, 128 * KiB)
        overdue = filler.stats().get("overdue_reservations")
        _, view = writer.buffer()
        view[slot.offset:slot.offset + size] = _pattern(7, size)
        kept, damaged = _damaged(filler, filled, 128 * KiB)
        assert kept and not damaged
        assert writer.commit(["writer/a"]) == [Status.OK]
        assert _get(filler, "writer/a") == _pattern(7, size)
        assert overdue == 1
    finally:
        writer.close()
        filler.close()
        pool.stop()


CLIENT = textwrap.dedent("""
    import sys
    from ascend_store.backends.base import Status
    from ascend_store.backends.local.client import LocalBackend
    from ascend_store.common.config import LocalPoolConfig
    b = LocalBackend(LocalPoolConfig(socket=sys.argv[1], start="never"), timeout_s=2.0)
    assert b.reserve(["held/w"], [1000])[0].status is Status.OK
    assert b.lease(["held/r"])[0].status is Status.OK
    print("holding", flush=True)
    sys.stdin.readline()
""")


def test_a_killed_clients_leases_and_reservations_are_reclaimed_after_their_ttl(sockdir):
    """The other side of never reclaiming from a live client: nothing leaks when it dies."""
    pool = ShortTtlPool(os.path.join(sockdir, "pool.sock")).start()
    client = pool.client()
    try:
        _put(client, "held/r", b"r" * 1000)
        holder = subprocess.Popen([sys.executable, "-c", CLIENT, pool.socket], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "holding"
        _past_ttl()
        st = client.stats()  # still alive: kept past their TTL
        assert (st["leases"], st["reserved"]) == (1, 1)
        holder.kill()
        holder.wait(10)
        _wait(lambda: client.stats()["reserved"] == 0, 5, "the dead writer's reservation to go")
        st = client.stats()
        assert st["leases"] == 0 and st["expired_leases"] == 1 and st["expired_reservations"] == 1
        assert client.remove(["held/r"]) == [Status.OK]
    finally:
        client.close()
        pool.stop()


STARTER = textwrap.dedent("""
    import sys
    from ascend_store.backends.local.client import LocalBackend
    from ascend_store.common.config import LocalPoolConfig
    b = LocalBackend(LocalPoolConfig(socket=sys.argv[1], capacity=1 << 20, start="auto",
                                     idle_exit_s=0.5), timeout_s=2.0)
    b.stats()
    print(b.started or 0, flush=True)
    sys.stdin.readline()
    b.close()
""")


def test_an_embedded_pool_outlives_its_starter_and_exits_after_its_last_client(sockdir):
    path = os.path.join(sockdir, "auto", "pool.sock")
    one = subprocess.Popen([sys.executable, "-c", STARTER, path], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    two = None
    pid = int(one.stdout.readline())
    try:
        assert pid and ping(path)["pid"] == pid  # the first client started it
        two = subprocess.Popen([sys.executable, "-c", STARTER, path], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        assert int(two.stdout.readline()) == 0  # the second joined it
        client = LocalBackend(LocalPoolConfig(socket=path, start="never"), timeout_s=2.0)
        _put(client, "kept/a", b"kept")
        client.close()
        one.kill()  # the starter dies (SIGKILL); the second client still uses the pool
        one.wait(10)
        time.sleep(1.5)
        assert ping(path)["pid"] == pid
        client = LocalBackend(LocalPoolConfig(socket=path, start="never"), timeout_s=2.0)
        assert _get(client, "kept/a") == b"kept"
        client.close()
        two.stdin.close()  # the last client leaves: the pool goes 0.5 s later
        two.wait(10)
        _wait(lambda: not _running(pid), 5, "the pool to exit")
        assert not os.path.exists(path)
    finally:
        for p in (one, two):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(10)
        _reap_orphan(pid)


def test_a_client_starts_its_pool_again_when_it_finds_it_killed(sockdir):
    path = os.path.join(sockdir, "pool.sock")
    b = LocalBackend(LocalPoolConfig(socket=path, capacity=1 << 20, start="auto", idle_exit_s=0.5),
                     timeout_s=1.0)
    pids = []
    try:
        _put(b, "before", b"x")
        old = ping(path)
        pids.append(old["pid"])
        os.kill(old["pid"], signal.SIGKILL)  # its socket stays behind; nothing answers there
        _wait(lambda: not _running(old["pid"]), 5, "the pool to die")
        with pytest.raises(BackendUnavailable):
            b.exists(["before"])  # finds it dead: a new pool starts off this thread
        _wait(lambda: (hello := ping(path)) is not None and hello["epoch"] != old["epoch"], 20,
              "a new pool at the socket")
        pids.append(ping(path)["pid"])
        assert b.exists(["before"]) == [False]  # a new, empty pool, and this client uses it
        _put(b, "after", b"y")
        assert _get(b, "after") == b"y"
    finally:
        b.close()
        for pid in pids:
            _wait(lambda pid=pid: not _running(pid), 5, "the pool to exit")
