"""One conformance suite, three backends: the local pool (a real pool process, with and
without a disk tier), Mooncake
(a real mooncake_master and mooncake_client storage process) and memcache (the real
memcache_hybrid 1.3.0 meta service and clients, over host_shm and over host_tcp).

Mooncake and memcache bind all interfaces, so their tests run only inside a private
network namespace with just loopback. memcache's client also needs the Ascend driver:
tests/backends/ascend_stub/sandbox.sh stands in for it (driver_stub.c) in a private mount
namespace. `make test` runs these tests inside that sandbox (which is also the network
namespace: ASCEND_STORE_NETNS=1, ASCEND_STORE_ASCEND_STUB=1).
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from ascend_store.common.config import LocalPoolConfig, MemcacheConfig, StoreServiceConfig
from tests.e2e.conftest import Pool

IN_NETNS = os.environ.get("ASCEND_STORE_NETNS") == "1"
IN_ASCEND_STUB = os.environ.get("ASCEND_STORE_ASCEND_STUB") == "1"
BIN = os.path.dirname(sys.executable)
# Below Linux's ephemeral range (32768+), so no outgoing connection holds a service port
# when its server binds it, and above the ports Mooncake's transfer engines pick at random.
_ports = itertools.count(26000, 10)


def _tail(path, n: int = 3000) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-n:]


def _wait_listening(port: int, proc: subprocess.Popen, log_path, what: str, within_s: float = 30.0):
    """Return once ``proc`` accepts connections on ``port``; fail with its log if it exits
    or does not come up (a slow CI machine needs longer than a fixed sleep)."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{_tail(log_path)}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} not listening on {port} after {within_s:.0f} s:\n{_tail(log_path)}")


def make_backend(kind: str, params: dict, timeout_s: float = 5.0, role: str = "worker"):
    """Build a backend from picklable params (also used in child processes). The default
    deadline is the config's: a fresh Mooncake or memcache backend's first call includes
    starting its client's helper process, on a CI machine busy with other tests."""
    if kind == "local":
        from ascend_store.backends.local.client import LocalBackend

        return LocalBackend(LocalPoolConfig(**params), timeout_s=timeout_s)
    if kind == "mooncake":
        from ascend_store.backends.mooncake import MooncakeBackend

        return MooncakeBackend(StoreServiceConfig(**params), timeout_s, role)
    from ascend_store.backends.memcache import MemcacheBackend

    return MemcacheBackend(MemcacheConfig.parse(params), timeout_s, role)


@dataclass
class Service:
    kind: str
    params: dict
    capacity: int
    start_fn: object
    stop_fn: object
    procs: dict = field(default_factory=dict)  # the running service processes by role, for SIGSTOP


    def backend(self, timeout_s: float = 5.0, role: str = "worker"):
        return make_backend(self.kind, self.params, timeout_s, role)

    def restart(self) -> None:
        self.stop_fn()
        self.start_fn()


def _local(tmp_path, disk: bool = False) -> Service:
    """The local pool; ``disk``: with a disk tier of half its memory (so writing twice the
    memory still evicts or refuses something)."""
    cap = 8 * 2**20
    extra = ("--disk-path", str(tmp_path / "disk"), "--disk-capacity", str(cap // 2)) if disk else ()
    pool = Pool(str(tmp_path / "pool" / "pool.sock"), capacity=str(cap), extra=extra)
    return Service("local", {"socket": pool.socket, "start": "never", "capacity": cap}, cap,
                   pool.start, pool.stop)


def _mooncake(tmp_path, capacity: int = 32 * 2**20) -> Service:
    if not IN_NETNS:
        pytest.skip("Mooncake binds all interfaces: run inside a private network namespace "
                    "(make test does: unshare -n, ASCEND_STORE_NETNS=1)")
    pytest.importorskip("mooncake.store")
    port = next(_ports)
    cap = capacity
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    procs: list[tuple[subprocess.Popen, object]] = []  # (process, its log)
    by_role: dict[str, subprocess.Popen] = {}
    starts = itertools.count()

    def spawn(name: str, args: list[str], listen_port: int, n: int) -> None:
        log_path = tmp_path / f"{name}-{n}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([f"{BIN}/{name}", *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log_path))
        by_role[name] = proc  # the wrapper execs the binary: this pid is the server's
        _wait_listening(listen_port, proc, log_path, name)

    def start():
        n = next(starts)
        spawn("mooncake_master", ["--rpc_address=127.0.0.1", f"--rpc_port={port}",
                                  f"--metrics_port={port + 1}"], port, n)
        # The client serves its port only after it has mounted its segment in the master.
        spawn("mooncake_client", ["--host=127.0.0.1", f"--port={port + 2}",
                                  f"--global_segment_size={cap // 2**20}MB",
                                  f"--master_server_address=127.0.0.1:{port}",
                                  "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"], port + 2, n)

    def stop():
        while procs:
            p, log_path = procs.pop()
            if p.poll() is not None:  # it died before we stopped it: show why in the test's output
                print(f"{p.args[0]} had exited ({p.returncode}):\n{_tail(log_path)}")
            p.kill()
            p.wait()

    params = {"master": f"127.0.0.1:{port}", "global_segment_size": 0, "staging_size": 64 * 2**20}
    return Service("mooncake", params, cap, start, stop, by_role)


_MEMCACHE_META = """
import sys, memcache_hybrid as m
c = m.MetaConfig()
c.meta_service_url, c.config_store_url, c.log_level = sys.argv[1], sys.argv[2], "error"
assert m.MetaService.setup(c) == 0
m.MetaService.main()
"""
# A client that only holds memory (like mooncake_client): objects put there outlive the
# engines that wrote them. It writes its service id to a file, then waits to be killed.
_MEMCACHE_STORAGE = """
import os, sys, time, memcache_hybrid as m
c = m.LocalConfig()
c.meta_service_url, c.config_store_url, c.protocol, c.dram_size = sys.argv[1:5]
s = m.DistributedObjectStore()
assert s.setup(c) == 0 and s.init(0) == 0
with open(sys.argv[5] + ".tmp", "w") as f:
    f.write(str(s.get_local_service_id()))
os.replace(sys.argv[5] + ".tmp", sys.argv[5])
time.sleep(3600)
"""


def _memcache(tmp_path, protocol: str, storage: int = 0) -> Service:
    """The meta service and, with ``storage`` bytes, a storage client; the backends under
    test contribute ``dram_size`` each (memcache places objects on any client)."""
    if not (IN_NETNS and IN_ASCEND_STUB):
        pytest.skip("memcache needs the Ascend driver stub and a private network namespace: run "
                    "inside tests/backends/ascend_stub/sandbox.sh (make test does)")
    pytest.importorskip("memcache_hybrid")
    port = next(_ports)
    meta, store = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    cap = 8 * 2**20
    procs: list[tuple[subprocess.Popen, object]] = []
    by_role: dict[str, subprocess.Popen] = {}
    starts = itertools.count()
    params = {"meta_service_url": meta, "config_store_url": store, "protocol": protocol,
              "dram_size": cap, "staging_size": 64 * 2**20}

    def start():
        n = next(starts)
        log_path = tmp_path / f"memcache-meta-{n}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-c", _MEMCACHE_META, meta, store],
                                    stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log_path))
        by_role["meta"] = proc
        _wait_listening(port, proc, log_path, "memcache meta service")
        if storage:
            log_path, id_path = tmp_path / f"memcache-storage-{n}.log", tmp_path / f"memcache-storage-{n}.id"
            with open(log_path, "w") as log:
                proc = subprocess.Popen([sys.executable, "-c", _MEMCACHE_STORAGE, meta, store, protocol,
                                         str(storage), str(id_path)], stdout=log, stderr=subprocess.STDOUT)
            procs.append((proc, log_path))
            by_role["storage"] = proc
            end = time.monotonic() + 60
            while not id_path.exists():
                if proc.poll() is not None or time.monotonic() > end:
                    stop()
                    raise RuntimeError(f"memcache storage client failed:\n{_tail(log_path)}")
                time.sleep(0.1)
            params["preferred_services"] = [int(id_path.read_text())]

    def stop():
        while procs:  # memcache's clients ignore SIGTERM
            p, log_path = procs.pop()
            if p.poll() is not None:
                print(f"memcache process had exited ({p.returncode}):\n{_tail(log_path)}")
            p.kill()
            p.wait()

    return Service("memcache", params, cap, start, stop, by_role)


@pytest.fixture(params=["local", "local-disk", "mooncake", "memcache-host_shm", "memcache-host_tcp"])
def service(request, tmp_path):
    kind, _, protocol = request.param.partition("-")
    if kind == "local":
        svc = _local(tmp_path, disk=protocol == "disk")
    else:
        svc = _memcache(tmp_path, protocol) if kind == "memcache" else _mooncake(tmp_path)
    svc.start_fn()
    yield svc
    svc.stop_fn()
