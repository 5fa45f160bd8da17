"""The 32-byte header of every layer part of a pool object, without torch: the pool server
reads and rewrites it too (backends/local/spill_int8.py), and it imports no torch.

    magic ``ASKV`` | version | flags | fingerprint (8) | payload bytes (8) | checksum (4) |
    codec id | element type

``elem`` names the payload's element type for raw pages of a standard attention layer
(K and V pages whose heads, tokens and channels are known), so a pool tier may store them
in a smaller lossy form; 0 for anything else (encoded payloads, recurrent state, tuple
caches, 8-bit caches), which every tier keeps byte for byte.
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = b"ASKV"
HEADER = struct.Struct("<4sHH8sQIHH")  # magic, version, flags, fingerprint, payload, crc, codec, elem
HEADER_BYTES = HEADER.size
HEADER_VERSION = 1
# The same header as a numpy record, for checking a layer's objects in one pass.
HEADER_RECORD = np.dtype([("magic", "S4"), ("version", "<u2"), ("flags", "<u2"), ("fp", "<u8"),
                          ("payload", "<u8"), ("crc", "<u4"), ("codec", "<u2"), ("elem", "<u2")])
assert HEADER_RECORD.itemsize == HEADER_BYTES
FLAG_CRC = 1  # ``crc`` is the payload's CRC32 (host writers of payloads that are not whole words)
FLAG_WSUM = 2  # ``crc`` is the folded word checksum of checksum.py (every other writer)
# The payload came back from a lossy tier form (INT8 on the disk tier): close to what was
# written, not equal. Readers that asked for lossless KV refuse it.
FLAG_LOSSY = 4
RAW_CODEC = 0
# ``elem`` codes: the payload's floating-point type (bf16 has no numpy type: uint16 bits).
ELEM_F32, ELEM_F16, ELEM_BF16 = 1, 2, 3
ELEM_BYTES = {ELEM_F32: 4, ELEM_F16: 2, ELEM_BF16: 2}
