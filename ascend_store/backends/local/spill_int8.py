"""The disk tier's INT8 form of an object (``disk_codec: int8``): attention pages spilled
from memory are stored at a quarter (fp32) or half (bf16, fp16) of their bytes, and come
back, on promotion, as raw pages close to the ones written.

The pool sees bytes, not caches, so the form needs no page layout: each layer part's
payload is cut into groups of ``GROUP`` consecutive values (in every layout vLLM uses, a
head's channels of one token are consecutive, so a group stays inside one head where 32
divides the head size, as 64 and 128 do), each group stored as INT8 with one fp16 scale
(its largest magnitude / 127). An object qualifies when every layer part is a
raw attention part of one float type and one size (header.py's ``elem``), its values are
finite and its groups whole; anything else (int8 or zstd objects, recurrent state, fp8
caches, tuple caches) is stored byte for byte.

Promotion rebuilds each part's header as written, with ``FLAG_LOSSY`` set and the word
checksum of the decoded payload, so readers check it like any object and readers that
asked for lossless KV refuse it. Quantizing a decoded object again gives the same INT8
values (each group's largest value is its scale times 127; tests/unit/test_spill_int8.py),
so a promoted object spilled again loses nothing more.

Stored form: ``[_HEAD][part headers][INT8 values][fp16 scales]``.
"""

from __future__ import annotations

import struct

import numpy as np

from ascend_store.common.checksum import wsum_rows
from ascend_store.common.header import (
    ELEM_BF16,
    ELEM_BYTES,
    ELEM_F16,
    ELEM_F32,
    FLAG_CRC,
    FLAG_LOSSY,
    FLAG_WSUM,
    HEADER_BYTES,
    HEADER_RECORD,
    HEADER_VERSION,
    MAGIC,
    RAW_CODEC,
)

GROUP = 32
_HEAD = struct.Struct("<QIIH6x")  # the object's bytes, parts, values per part, elem
HEAD_BYTES = _HEAD.size
_F16_MIN = np.float32(np.finfo(np.float16).tiny)  # scales stay normal fp16 numbers
_NO_SIGN, _INF_BITS = np.uint32(0x7FFFFFFF), 0x7F800000


def encode(obj) -> bytes | None:
    """The INT8 form of a pool object (a buffer of its bytes), or None to store it as is."""
    a = np.frombuffer(obj, dtype=np.uint8)
    if len(a) < HEADER_BYTES:
        return None
    first = a[:HEADER_BYTES].view(HEADER_RECORD)[0]
    elem, n = int(first["elem"]), int(first["payload"])
    size = ELEM_BYTES.get(elem, 0)
    if not size or n == 0 or n % (GROUP * size) or len(a) % (HEADER_BYTES + n):
        return None
    rows = a.reshape(-1, HEADER_BYTES + n)
    heads = rows[:, :HEADER_BYTES].copy().view(HEADER_RECORD)[:, 0]
    if ((heads["magic"] != MAGIC) | (heads["version"] != HEADER_VERSION) | (heads["codec"] != RAW_CODEC)
            | (heads["elem"] != elem) | (heads["payload"] != n)).any():
        return None
    x = _floats(rows[:, HEADER_BYTES:], elem).reshape(len(rows), -1, GROUP)
    # Each group's largest magnitude, on the bits (twice as fast as on the floats): without
    # its sign a float orders as an integer, and inf and NaN order above every finite value.
    mag = np.bitwise_and(x.view(np.uint32), _NO_SIGN).view(np.int32).max(axis=2)
    if (mag >= _INF_BITS).any():
        return None
    scale = np.maximum(mag.view(np.float32) / np.float32(127), _F16_MIN).astype(np.float16)
    g = x * (np.float32(1) / scale.astype(np.float32))[..., None]
    np.rint(g, out=g)
    np.clip(g, -127, 127, out=g)
    q = g.astype(np.int8)
    return b"".join((_HEAD.pack(len(a), len(rows), n // size, elem), heads.tobytes(), q.tobytes(),
                     scale.tobytes()))


def object_size(head: bytes) -> int:
    """The object's own size, from the first ``_HEAD.size`` bytes of its INT8 form."""
    return _HEAD.unpack(head[:_HEAD.size])[0]


def decode(form, dest) -> bool:
    """Write the object an INT8 form stands for into ``dest`` (a writable buffer of the
    object's size); False when the form does not add up (then ``dest`` is left undefined)."""
    b = np.frombuffer(form, dtype=np.uint8)
    if len(b) < _HEAD.size:
        return False
    total, parts, values, elem = _HEAD.unpack(b[:_HEAD.size].tobytes())
    size = ELEM_BYTES.get(elem, 0)
    groups = values // GROUP
    if (not size or values % GROUP or total != parts * (HEADER_BYTES + values * size)
            or len(b) != _HEAD.size + parts * (HEADER_BYTES + values + 2 * groups)):
        return False
    at = _HEAD.size
    heads = b[at:at + parts * HEADER_BYTES].copy().view(HEADER_RECORD)
    at += parts * HEADER_BYTES
    q = b[at:at + parts * values].view(np.int8).reshape(parts, groups, GROUP)
    scale = b[at + parts * values:].view(np.float16).reshape(parts, groups, 1).astype(np.float32)
    y = q.astype(np.float32)
    y *= scale
    pages = _to_elem(y.reshape(parts, values), elem).view(np.uint8)
    checked = (heads["flags"] & (FLAG_CRC | FLAG_WSUM)) != 0
    heads["flags"] = np.where(checked, FLAG_WSUM, 0) | FLAG_LOSSY
    heads["crc"] = np.where(checked, wsum_rows(pages), 0)
    rows = np.frombuffer(dest, dtype=np.uint8).reshape(parts, HEADER_BYTES + values * size)
    rows[:, :HEADER_BYTES] = heads.view(np.uint8).reshape(parts, HEADER_BYTES)
    rows[:, HEADER_BYTES:] = pages
    return True


def _floats(payload: np.ndarray, elem: int) -> np.ndarray:
    """A payload's values [rows, bytes] as float32 [rows, values] (a view for fp32)."""
    if elem == ELEM_F32:
        return payload.view(np.float32)
    if elem == ELEM_F16:
        return payload.view(np.float16).astype(np.float32)
    assert elem == ELEM_BF16  # a bf16 is the high half of a float32 (little-endian)
    halves = np.zeros((*payload.shape[:-1], payload.shape[-1] // 2, 2), dtype=np.uint16)
    halves[..., 1] = payload.view(np.uint16)
    return halves.view(np.float32)[..., 0]


def _to_elem(x: np.ndarray, elem: int) -> np.ndarray:
    """float32 values (an array this module owns: bf16 rounds in place) in the payload's
    type, bf16 rounded to nearest even as torch does."""
    if elem == ELEM_F32:
        return x
    if elem == ELEM_F16:
        return x.astype(np.float16)
    assert elem == ELEM_BF16
    u = x.view(np.uint32)
    r = u >> 16
    r &= 1
    r += 0x7FFF
    r += u
    r >>= 16
    return r.astype(np.uint16)
