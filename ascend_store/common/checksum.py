"""The word checksum the batched copy computes on the way (``FLAG_WSUM`` in a header).

Fletcher-like over a payload's 8-byte words w_i: s1 = sum(w_i), s2 = sum((i + 1) * w_i),
mod 2**64. It is cheap on any device, the copy kernels accumulate it per object on the way
through (a segment at payload word p adds its local sums shifted by p: ``combine_sums``). A flipped
bit changes s1; reordered words change s2; the header keeps a 32-bit mix of both. A leaf
module without torch: transfer.py checks it on the host, segments.py, device_path.py and
int8_path.py on the way, and the pool server seals what its disk tier decodes.
"""

from __future__ import annotations

import numpy as np


def _mix(z):
    """splitmix64's finalizer (numpy uint64 arrays wrap like the ints here are masked)."""
    z = (z ^ (z >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> _U(27))) * _U(0x94D049BB133111EB)
    return z ^ (z >> _U(31))


def _U(v: int):
    return np.uint64(v)


def fold_array(s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = _mix(_mix(s1) ^ s2)
    return ((h ^ (h >> _U(32))) & _U(0xFFFFFFFF)).astype(np.int64)


def combine_sums(s1: np.ndarray, t: np.ndarray, payload_word: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Folded checksums of objects from their segments' (s1, t) word sums (uint64, along
    the last axis), where a segment at word ``payload_word`` of its object's payload adds
    s1 and t + payload_word * s1, and each object's segments run from its ``first`` to
    the next one's."""
    with np.errstate(over="ignore"):
        s2 = t + payload_word.astype(np.uint64) * s1
        return fold_array(np.add.reduceat(s1, first, axis=-1), np.add.reduceat(s2, first, axis=-1))


def wsum_rows(rows: np.ndarray) -> np.ndarray:
    """The folded word checksum of each row of ``rows`` [N, bytes] (uint8, bytes % 8 == 0)."""
    w = np.ascontiguousarray(rows).view(np.uint64)
    i = np.arange(1, w.shape[1] + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return fold_array(w.sum(axis=1, dtype=np.uint64), (w * i).sum(axis=1, dtype=np.uint64))


def wsum_host(payload: np.ndarray) -> int:
    """The folded word checksum of a payload in host memory (uint8, length % 8 == 0)."""
    return int(wsum_rows(payload.reshape(1, -1))[0])
