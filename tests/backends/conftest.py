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
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from ascend_store.config import LocalPoolConfig, StoreServiceConfig
from tests.e2e.conftest import Pool

IN_NETNS = os.environ.get("ASCEND_STORE_NETNS") == "1"
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
    procs: list[tuple[subprocess.Popen, object]] = []  # (process, its log)
    starts = itertools.count()

    def spawn(name: str, args: list[str], listen_port: int, n: int) -> None:
        log_path = tmp_path / f"{name}-{n}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([f"{BIN}/{name}", *args], env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log_path))
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
