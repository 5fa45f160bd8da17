"""The behaviour every backend must share (see tests/backends/conftest.py for the backends)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from ascend_store.backends.base import TIER_MEMORY, TIER_NONE, BackendUnavailable, Status
from tests.backends.conftest import make_backend


def _put(b, objs: dict[str, bytes]) -> list[Status]:
    slots = b.reserve(list(objs), [len(v) for v in objs.values()])
    _, view = b.buffer()
    for s, v in zip(slots, objs.values()):
        if s.status is Status.OK:
            view[s.offset:s.offset + s.size] = v
    return b.commit([k for k, s in zip(objs, slots) if s.status is Status.OK])


def _get(b, keys: list[str], size: int) -> dict[str, bytes | None]:
    slots = b.lease(keys, [size] * len(keys))
    _, view = b.buffer()
    out = {k: bytes(view[s.offset:s.offset + s.size]) if s.status is Status.OK else None
           for k, s in zip(keys, slots)}
    b.release([k for k, s in zip(keys, slots) if s.status is Status.OK])
    return out


def _data(tag: int, n: int) -> bytes:
    return bytes((tag * 131 + i * 7) % 251 for i in range(n))


def test_round_trip_is_byte_exact(service):
    b = service.backend()
    objs = {f"ns/g0/tp0of1/L{i}/aa": _data(i, n) for i, n in enumerate((1000, 4096, 70000))}
    assert _put(b, objs) == [Status.OK] * 3
    assert b.exists(list(objs)) == [True] * 3
    got = _get(b, list(objs), 70000)
    assert got == objs
    b.close()


def test_missing_keys_and_partial_batches(service):
    b = service.backend()
    _put(b, {"k/a": _data(1, 500), "k/c": _data(3, 700)})
    assert b.exists(["k/a", "k/b", "k/c"]) == [True, False, True]
    assert b.tiers(["k/a", "k/b", "k/c"]) == [TIER_MEMORY, TIER_NONE, TIER_MEMORY]  # just stored
    slots = b.lease(["k/a", "k/b", "k/c"], [1000] * 3)
    assert [s.status for s in slots] == [Status.OK, Status.MISSING, Status.OK]
    _, view = b.buffer()
    assert bytes(view[slots[2].offset:slots[2].offset + slots[2].size]) == _data(3, 700)
    b.release(["k/a", "k/c"])
    b.close()


def test_an_existing_object_is_never_overwritten(service):
    b = service.backend()
    _put(b, {"k/x": _data(1, 800)})
    assert b.reserve(["k/x"], [800])[0].status is Status.EXISTS
    assert _get(b, ["k/x"], 800)["k/x"] == _data(1, 800)
    b.close()


def _writer(kind, params, q, done):
    b = make_backend(kind, params)
    q.put(_put(b, {f"proc/{i}": _data(i, 3000 + i) for i in range(10)}))
    done.wait(60)  # memcache keeps objects in the memory of the client that put them
    b.close()


def test_two_client_processes_share_objects(service):
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_writer, args=(service.kind, service.params, q, done))
    p.start()
    try:
        assert q.get(timeout=60) == [Status.OK] * 10
        b = service.backend()
        assert _get(b, [f"proc/{i}" for i in range(10)], 4000) == {f"proc/{i}": _data(i, 3000 + i)
                                                                  for i in range(10)}
        b.close()
    finally:
        done.set()
        p.join(30)


def test_writing_past_capacity_never_raises_and_never_returns_wrong_bytes(service):
    b = service.backend()
    n, size = 2 * service.capacity // 2**20, 2**20 - 4096
    for i in range(n):
        _put(b, {f"cap/{i}": _data(i, size)})
    got = _get(b, [f"cap/{i}" for i in range(n)], size)
    readable = [k for k, v in got.items() if v is not None]
    assert all(got[k] == _data(int(k.split("/")[1]), size) for k in readable)
    assert len(readable) < n  # something was evicted or refused
    assert len(readable) * size >= service.capacity // 4
    b.close()


def test_leased_bytes_stay_valid_until_release(service):
    b = service.backend()
    _put(b, {"lease/a": _data(9, 5000)})
    slot = b.lease(["lease/a"], [5000])[0]
    b.remove(["lease/a"])  # refused while leased (local) or removed under a private copy
    for i in range(20):  # pressure on the same memory
        _put(b, {f"lease/fill{i}": _data(i, 5000)})
    _, view = b.buffer()
    assert bytes(view[slot.offset:slot.offset + slot.size]) == _data(9, 5000)
    b.release(["lease/a"])
    b.close()


def test_unreachable_service_fails_within_the_timeout(service):
    service.stop_fn()
    b = service.backend(timeout_s=1.0)
    t = time.monotonic()
    with pytest.raises(BackendUnavailable):
        b.exists(["k/a"])
    with pytest.raises(BackendUnavailable):
        b.reserve(["k/a"], [10])
    assert time.monotonic() - t < 5
    b.close()
    service.start_fn()


def test_backend_works_again_after_the_service_restarts(service):
    b = service.backend()
    assert _put(b, {"r/a": _data(1, 100)}) == [Status.OK]
    service.restart()
    deadline, ok = time.monotonic() + 20, None
    while time.monotonic() < deadline:
        try:
            ok = _put(b, {"r/b": _data(2, 100)})
            break
        except BackendUnavailable:
            time.sleep(0.5)
    assert ok == [Status.OK]
    assert _get(b, ["r/b"], 100)["r/b"] == _data(2, 100)
    b.close()


@pytest.fixture(autouse=True)
def _no_proxy_env(monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    yield
    os.environ.pop("MC_STORE_DUMMY", None)
