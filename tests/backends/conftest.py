"""One conformance suite, three backends: the local pool (a real pool process), Mooncake
(a real mooncake_master and mooncake_client storage process) and memcache (a stand-in of
its client API: its data plane needs Ascend hardware).

Mooncake binds all interfaces, so its tests run only inside a private network namespace
with just loopback: `make test` runs them with `unshare -n` and ASCEND_STORE_NETNS=1.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from ascend_store.config import LocalPoolConfig, StoreServiceConfig
from tests.e2e.conftest import Pool

IN_NETNS = os.environ.get("ASCEND_STORE_NETNS") == "1"
BIN = os.path.dirname(sys.executable)
_ports = itertools.count(51000, 10)


def make_backend(kind: str, params: dict, timeout_s: float = 2.0, role: str = "worker"):
    """Build a backend from picklable params (also used in child processes)."""
    if kind == "local":
        from ascend_store.backends.local.client import LocalBackend

        return LocalBackend(LocalPoolConfig(**params), timeout_s=timeout_s)
    if kind == "mooncake":
        from ascend_store.backends.mooncake import MooncakeBackend

        return MooncakeBackend(StoreServiceConfig(**params), timeout_s, role)
    from ascend_store.backends.memcache import MemcacheBackend
    from tests.backends import memcache_standin

    sys.modules["memcache_hybrid"] = memcache_standin  # the stand-in, see its docstring
    return MemcacheBackend(StoreServiceConfig(**params), timeout_s, role)


@dataclass
class Service:
    kind: str
    params: dict
    capacity: int
    start_fn: object
    stop_fn: object

    def backend(self, timeout_s: float = 2.0, role: str = "worker"):
        return make_backend(self.kind, self.params, timeout_s, role)

    def restart(self) -> None:
        self.stop_fn()
        self.start_fn()


def _local(tmp_path) -> Service:
    cap = 8 * 2**20
    pool = Pool(str(tmp_path / "pool" / "pool.sock"), capacity=str(cap))
    return Service("local", {"socket": pool.socket, "start": "never", "capacity": cap}, cap,
                   pool.start, pool.stop)


def _mooncake(tmp_path) -> Service:
    if not IN_NETNS:
        pytest.skip("Mooncake binds all interfaces: run inside a private network namespace "
                    "(make test does: unshare -n, ASCEND_STORE_NETNS=1)")
    pytest.importorskip("mooncake.store")
    port = next(_ports)
    cap = 32 * 2**20
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    procs: list[subprocess.Popen] = []

    def start():
        log = open(tmp_path / f"mooncake-{len(procs)}.log", "w")
        procs.append(subprocess.Popen([f"{BIN}/mooncake_master", "--rpc_address=127.0.0.1",
                                       f"--rpc_port={port}", f"--metrics_port={port + 1}"],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
        time.sleep(0.5)
        procs.append(subprocess.Popen([f"{BIN}/mooncake_client", "--host=127.0.0.1", f"--port={port + 2}",
                                       f"--global_segment_size={cap // 2**20}MB",
                                       f"--master_server_address=127.0.0.1:{port}",
                                       "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
        time.sleep(1.5)

    def stop():
        while procs:
            p = procs.pop()
            p.kill()
            p.wait()

    params = {"master": f"127.0.0.1:{port}", "global_segment_size": 0, "staging_size": 64 * 2**20}
    return Service("mooncake", params, cap, start, stop)


def _memcache(tmp_path) -> Service:
    d = tmp_path / "memcache"
    cap = 8 * 2**20

    def start():
        d.mkdir(exist_ok=True)
        (d / "capacity").write_text(str(cap))

    def stop():
        shutil.rmtree(d, ignore_errors=True)

    return Service("memcache", {"master": f"file://{d}", "staging_size": 64 * 2**20}, cap, start, stop)


@pytest.fixture(params=["local", "mooncake", "memcache"])
def service(request, tmp_path):
    svc = {"local": _local, "mooncake": _mooncake, "memcache": _memcache}[request.param](tmp_path)
    svc.start_fn()
    yield svc
    svc.stop_fn()
