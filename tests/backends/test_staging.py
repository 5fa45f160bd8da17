"""The staging buffer's slots (backends/staging.py): one region per call, returned when
its last key goes, never two slots over the same bytes."""

from __future__ import annotations

import numpy as np

from ascend_store.backends.staging import Staging

KIB = 1024


def _keys(prefix: str, n: int) -> list[str]:
    return [f"{prefix}/{i}" for i in range(n)]


def test_slots_of_a_call_are_disjoint_and_inside_the_buffer():
    s = Staging(1024 * KIB)
    sizes = np.array([1000, 4096, 1, 70000], dtype=np.int64)
    offs = s.take(_keys("a", 4), sizes)
    assert (offs >= 0).all() and (offs + sizes <= s.size).all()
    spans = sorted(zip(offs.tolist(), (offs + sizes).tolist()))
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    found, got = s.find(["a/3", "a/0", "nope"])
    assert found.tolist() == [offs[3], offs[0], -1] and got.tolist() == [70000, 1000, 0]
    view = s.view()
    view[offs[3]:offs[3] + 5] = b"hello"  # the worker writes where the helper reads
    assert bytes(s.view()[offs[3]:offs[3] + 5]) == b"hello"


def test_a_region_returns_when_its_last_key_goes():
    s = Staging(256 * KIB)
    s.take(_keys("a", 3), np.full(3, 10 * KIB, dtype=np.int64))
    s.take(_keys("b", 2), np.full(2, 10 * KIB, dtype=np.int64))
    s.free(["a/0", "a/1", "b/0", "unknown"])
    assert s.stats() == (50 * KIB, 2)  # a/2 and b/1 still hold their regions
    s.free(["a/2", "b/1", "a/2"])
    assert s.stats() == (0, 0)


def test_held_repeated_and_unwanted_keys_get_no_slot():
    s = Staging(256 * KIB)
    s.take(["x"], np.array([100], dtype=np.int64))
    offs = s.take(["x", "y", "y", "z"], np.full(4, 100, dtype=np.int64),
                  want=np.array([True, True, True, False]))
    assert offs.tolist()[0] == -1 and offs[1] >= 0 and offs.tolist()[2:] == [-1, -1]
    s.free(["x", "y"])
    assert s.stats() == (0, 0)


def test_a_call_beyond_the_space_gets_its_leading_keys():
    s = Staging(100 * KIB)
    offs = s.take(_keys("a", 8), np.full(8, 30 * KIB, dtype=np.int64))
    assert (offs[:3] >= 0).all() and (offs[3:] == -1).all()
    assert s.take(["b"], np.array([30 * KIB], dtype=np.int64)).tolist() == [-1]
    s.free(_keys("a", 8))
    assert s.take(["b"], np.array([30 * KIB], dtype=np.int64))[0] >= 0
