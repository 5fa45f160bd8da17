"""Wire format of the local pool: msgpack maps over a ZeroMQ socket (never pickle).

Request:  {"op": str, "keys": [str], "sizes": [int] | bytes, "since": int, "cursor": int}
Reply:    {"ok": bool, "epoch": str, "gone": int, "gone_keys": bytes | None,
           ...op-specific fields..., "error": str}
Per-key integers on the hot path travel packed (msgpack bin of little-endian int64): the
sizes of a ``reserve``, the status/offsets/sizes answering ``reserve`` and ``lease``.
``since`` is how many deleted objects the client has heard of; the reply's ``gone_keys``
names those deleted after them (object digests, 8 bytes each: base.object_digest), or is
None when the pool no longer remembers them all. ``events`` answers the event log's
entries after ``cursor`` (events.py): ``cursor``, ``lost``, ``codes`` (bytes),
``event_keys``. Both directions are size-bounded: a
client decodes a reply under limits too, so a pool cannot make it allocate without end.
"""

from __future__ import annotations

import msgpack
import numpy as np

from ascend_store.common.keys import KEY_RE

MAX_MESSAGE_BYTES = 16 * 2**20
MAX_KEYS_PER_CALL = 65536
GONE_RING = 65536  # deleted objects the pool remembers for clients that lag
OPS = ("hello", "exists", "tiers", "reserve", "commit", "abort", "lease", "release", "remove",
       "stats", "list", "events")


class ProtocolError(ValueError):
    pass


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack_request(data: bytes) -> dict:
    """Decode and validate one request; raise ProtocolError on anything malformed."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message too large")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True,
                              max_array_len=MAX_KEYS_PER_CALL, max_map_len=16,
                              max_str_len=4096, max_bin_len=MAX_KEYS_PER_CALL * 8)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable message: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or msg.get("op") not in OPS:
        raise ProtocolError("expected a map with a known 'op'")
    keys = msg.get("keys", [])
    if not isinstance(keys, list) or not all(isinstance(k, str) and KEY_RE.fullmatch(k) for k in keys):
        raise ProtocolError("keys must be a list of strings matching " + KEY_RE.pattern)
    sizes = msg.get("sizes", [])
    if isinstance(sizes, bytes) and len(sizes) % 8 == 0:
        sizes = msg["sizes"] = np.frombuffer(sizes, dtype="<i8").tolist()
    if not isinstance(sizes, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise ProtocolError("sizes must be positive integers (a list, or packed int64)")
    if msg["op"] == "reserve" and len(sizes) != len(keys):
        raise ProtocolError("reserve needs one size per key")
    if not isinstance(msg.get("owner", ""), str) or len(msg.get("owner", "")) > 64:
        raise ProtocolError("owner must be a short string")
    prefix = msg.get("prefix", "")
    if not isinstance(prefix, str) or len(prefix) > 256:
        raise ProtocolError("prefix must be a short string")
    for name in ("since", "cursor"):
        value = msg.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ProtocolError(f"{name} must be a non-negative integer")
    return msg


def unpack_reply(data: bytes) -> dict:
    """Decode one reply under the same kind of bounds; ProtocolError on anything else."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("reply too large")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True,
                              max_array_len=MAX_KEYS_PER_CALL, max_map_len=64,
                              max_str_len=4096, max_bin_len=GONE_RING * 8)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable reply: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("ok"), bool) \
            or not isinstance(msg.get("epoch"), str):
        raise ProtocolError("a reply must be a map with 'ok' and 'epoch'")
    return msg
