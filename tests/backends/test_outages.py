"""Outages of a distributed store (Mooncake, memcache) never freeze the engine's process and
leak nothing.

A stuck service is a SIGSTOPped process: its sockets accept connections, nothing answers.
While it is stopped, calls on an established client and on a fresh one (an engine that
starts, or sets its client up again) must each end within their deadline, and a ticker
thread must keep running (the Mooncake binding holds the GIL while it sets up a client);
once the service resumes, the same clients load their objects again. A thousand failed or
timed-out calls during an outage return every staging byte, start no thread or process
that stays, and the same client stores and loads again once the service is back.

Runs in the sandbox of the Makefile's `test` target (private network namespace; the Ascend
driver stub for memcache); skipped elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ascend_store.backends.base import BackendUnavailable, Status
from tests.backends.conftest import _memcache, _mooncake
from tests.backends.test_conformance import _data, _get, _put
from tests.e2e.conftest import REPO
from tests.unit.test_local_pool import _running

STOP_S = 4.0  # how long the service stays stopped
TIMEOUT_S = 1.0  # the backends' call deadline
SIZE = 64 * 1024


class Ticker(threading.Thread):
    """Wakes every 10 ms and keeps the longest gap between two wake-ups: how long the
    process's other Python threads (the engine) could not run."""

    def __init__(self):
        super().__init__(daemon=True)
        self.longest = 0.0
        self._done = threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self._done.wait(0.01):
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def stop(self) -> float:
        self._done.set()
        self.join()
        return self.longest


def _helpers(owner: int | None = None) -> dict[int, str]:
    """Store helper processes of ``owner`` (this process) by pid, with their state (Z: exited,
    never reaped): every child that is one, and every child that exited unreaped."""
    owner = os.getpid() if owner is None else owner
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read().rpartition(")")[2].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(stat[1]) == owner and (b"ascend_store.backends.helper_main" in cmd or stat[0] == "Z"):
            out[int(pid)] = stat[0]
    return out


def _until(fn, within_s: float = 30.0):
    """``fn()`` once it stops raising BackendUnavailable (the service is back)."""
    end = time.monotonic() + within_s
    while True:
        try:
            return fn()
        except BackendUnavailable:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


@pytest.fixture(params=["mooncake-mooncake_master", "mooncake-mooncake_client", "memcache-meta"])
def stuck(request, tmp_path):
    """(service, the role of the process to stop). memcache's objects go to a storage client
    of their own, so that a client's helper process may be restarted without losing them."""
    kind, _, role = request.param.partition("-")
    svc = _mooncake(tmp_path) if kind == "mooncake" else _memcache(tmp_path, "host_shm", storage=64 * 2**20)
    svc.start_fn()
    yield svc, role
    for p in svc.procs.values():  # never leave a stopped process behind
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
    svc.stop_fn()


def _load(b, i: int, objs: dict) -> None:
    _get(b, list(objs), SIZE)


def _save(b, i: int, objs: dict) -> None:
    _put(b, {f"new/{id(b)}/{i}": _data(i, SIZE)})


@pytest.mark.parametrize("phase", [_load, _save], ids=["load", "save"])
def test_a_stuck_service_never_freezes_the_process(stuck, phase):
    svc, role = stuck
    old = svc.backend(timeout_s=TIMEOUT_S)
    objs = {f"s/{i}": _data(i, SIZE) for i in range(4)}
    assert _until(lambda: _put(old, objs)) == [Status.OK] * 4
    threads = threading.active_count()
    pid = svc.procs[role].pid
    # Resumed by another process: an old client frozen with the GIL held cannot do it.
    resume = subprocess.Popen(["sh", "-c", f"sleep {STOP_S}; kill -CONT {pid}"])
    os.kill(pid, signal.SIGSTOP)
    ticker = Ticker()
    ticker.start()
    fresh = svc.backend(timeout_s=TIMEOUT_S)  # its first call sets its client up
    took, failed, i = [], 0, 0
    while resume.poll() is None:
        for b in (old, fresh):
            t0 = time.monotonic()
            try:
                phase(b, i, objs)
            except BackendUnavailable:
                failed += 1
            took.append(time.monotonic() - t0)
        i += 1
    longest = ticker.stop()
    # Both clients load what was stored before the stop, and save again: no restart.
    for b in (old, fresh):
        assert _until(lambda: _get(b, list(objs), SIZE)) == objs
        assert _until(lambda: _put(b, {f"after/{id(b)}": _data(7, SIZE)})) == [Status.OK]
        assert _get(b, [f"after/{id(b)}"], SIZE)[f"after/{id(b)}"] == _data(7, SIZE)
    print(f"{role} stopped {STOP_S}s: {len(took)} calls, {failed} failed, longest call "
          f"{max(took):.2f}s, longest tick gap {longest:.3f}s")
    assert failed > 0  # the service was stopped for the calls
    assert longest < 1.0, f"the process froze for {longest:.1f}s"
    assert max(took) < TIMEOUT_S + 1.0, f"a call took {max(took):.1f}s (deadline {TIMEOUT_S}s)"
    for b in (old, fresh):
        assert (b.stats()["used_bytes"], b.stats()["staging_slots"]) == (0, 0)
    assert threading.active_count() <= threads
    assert len(_helpers()) <= 2 and "Z" not in _helpers().values()
    old.close()
    fresh.close()


@pytest.fixture(params=["mooncake", "memcache"])
def service_down(request, tmp_path):
    svc = _mooncake(tmp_path) if request.param == "mooncake" else _memcache(tmp_path, "host_shm")
    svc.start_fn()
    yield svc
    svc.stop_fn()


def test_a_thousand_failed_calls_leak_nothing_and_hits_resume(service_down):
    svc = service_down
    b = svc.backend(timeout_s=0.5)
    assert _until(lambda: _put(b, {"warm": _data(1, SIZE)})) == [Status.OK]
    threads, helpers = threading.active_count(), len(_helpers())
    staged = {f"o/{i}": _data(i, SIZE) for i in range(8)}  # reserved before, committed during the outage
    slots = b.reserve(list(staged), [SIZE] * len(staged))
    _, view = b.buffer()
    for s, v in zip(slots, staged.values()):
        view[s.offset:s.offset + s.size] = v
    role = "mooncake_master" if svc.kind == "mooncake" else "meta"
    # The service hangs (calls time out), then it is gone (calls fail at once).
    os.kill(svc.procs[role].pid, signal.SIGSTOP)
    calls = [lambda i: b.commit(list(staged))] + [lambda i: b.lease([f"o/{i % 8}", "warm"], [SIZE] * 2)] * 9
    for i, call in enumerate(calls):
        with pytest.raises(BackendUnavailable):
            call(i)
    svc.stop_fn()
    ops = (lambda i: b.lease([f"o/{i % 8}", f"x/{i}"], [SIZE, 2 * SIZE]),
           lambda i: b.reserve([f"n/{i}"], [SIZE]), lambda i: b.exists([f"n/{i}"]))
    served = 0  # calls that found anything: none may while the service is down
    for i in range(1000 - len(calls)):
        try:
            out = ops[i % 3](i)
            served += any(s is True or getattr(s, "status", None) is Status.OK for s in out)
        except BackendUnavailable:
            pass
    assert served == 0
    with pytest.raises(BackendUnavailable):  # no sign of life from stats either
        b.stats()
    svc.start_fn()
    # The same client stores and loads again.
    assert _until(lambda: _put(b, {"back": _data(3, SIZE)})) == [Status.OK]
    assert _get(b, ["back"], SIZE) == {"back": _data(3, SIZE)}
    assert (b.stats()["used_bytes"], b.stats()["staging_slots"]) == (0, 0)
    assert threading.active_count() <= threads
    assert len(_helpers()) <= helpers and "Z" not in _helpers().values()
    b.close()


_OWNER = """
import sys, time
from tests.backends.conftest import make_backend
b = make_backend("mooncake", {"master": sys.argv[1], "global_segment_size": 0, "staging_size": 2**20})
b.exists(["k"])
print("ready", flush=True)
time.sleep(600)
"""


def test_mooncake_helper_dies_with_its_owner_and_comes_back_when_killed(tmp_path):
    svc = _mooncake(tmp_path)
    svc.start_fn()
    try:
        # Killed: the next call starts another helper, and the client works on.
        b = svc.backend(timeout_s=TIMEOUT_S)
        assert _until(lambda: _put(b, {"k/1": _data(1, SIZE)})) == [Status.OK]
        [first] = _helpers()
        os.kill(first, signal.SIGKILL)
        assert _until(lambda: _get(b, ["k/1"], SIZE)) == {"k/1": _data(1, SIZE)}
        [second] = _helpers()
        assert second != first and _helpers()[second] != "Z"
        b.close()
        assert _helpers() == {}
        # Its owner killed: the helper goes too.
        owner = subprocess.Popen([sys.executable, "-c", _OWNER, svc.params["master"]], stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, "PYTHONPATH": REPO})
        assert owner.stdout.readline().strip() == "ready"
        [helper] = _helpers(owner.pid)
        owner.kill()
        owner.wait()
        end = time.monotonic() + 10
        while _running(helper) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _running(helper)
    finally:
        svc.stop_fn()




def test_an_outage_is_warned_once_even_between_local_calls(service_down, caplog):
    """A staged store answers ``buffer`` and ``events`` from its own process: between two
    failed calls they must not count as the service coming back (which ended the outage
    and warned a second time)."""
    from ascend_store.backends.guard import GuardedBackend

    svc = service_down
    svc.stop_fn()
    guard = GuardedBackend(svc.backend(timeout_s=TIMEOUT_S), f"{svc.kind} once",
                           first_backoff_s=0.1, max_backoff_s=0.1)
    try:
        with caplog.at_level("DEBUG", logger="ascend_store"):
            for _ in range(3):
                with pytest.raises(BackendUnavailable):
                    guard.exists(["k"])
                time.sleep(0.25)  # past the backoff: the next call is tried
                guard.buffer()
                guard.events(0)
        said = [r for r in caplog.records if r.levelname == "WARNING"]
        assert [r.getMessage().count("recompute until it is back") for r in said] == [1]
    finally:
        guard.close()
