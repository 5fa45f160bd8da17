"""The word checksum the batched copy computes on the way (``FLAG_WSUM`` in a header).

Fletcher-like over a payload's 8-byte words w_i: s1 = sum(w_i), s2 = sum((i + 1) * w_i),
mod 2**64. It is cheap on any device, the copy kernels accumulate it per object on the way
through (a segment at payload word p adds its local sums shifted by p: ``combine_sums``). A flipped
bit changes s1; reordered words change s2; the header keeps a 32-bit mix of both. A leaf
module: transfer.py checks it on the host, segments.py and device_path.py on the way.
"""

from __future__ import annotations

import numpy as np
import torch


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


def word_sums(rows: torch.Tensor) -> torch.Tensor:
    """(s1, s2) of each payload row [N, bytes] (bytes % 8 == 0), on the rows' device: the
    checksum's one definition; int64 arithmetic wraps like the uint64 sums it stands for."""
    w = rows.view(torch.int64)
    i = torch.arange(1, w.shape[1] + 1, dtype=torch.int64, device=w.device)
    return torch.stack([w.sum(1), (w * i).sum(1)], dim=1)


def fold_sums(sums: np.ndarray) -> list[int]:
    """The 32-bit values stored in headers for per-object (s1, s2) rows (``word_sums``).
    Both sums go through a 64-bit mixer, so a change in either changes the result (a
    plain xor of the two would cancel a change that moves both sums alike)."""
    u = sums.astype(np.int64).view(np.uint64)
    return fold_array(u[:, 0], u[:, 1]).tolist()


def wsum_host(payload: np.ndarray) -> int:
    """The folded word checksum of a payload in host memory (uint8, length % 8 == 0)."""
    return fold_sums(word_sums(torch.from_numpy(payload).view(1, -1)).numpy())[0]
