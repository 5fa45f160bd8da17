"""What a backend and its store helper process (helper.py, helper_main.py) exchange: typed
messages over a private stream socket, and the interface a store client implements there.

Frames are a 4-byte little-endian length and a msgpack list (never pickle). Per-key integers
travel packed (little-endian int64), as on the local pool's wire. Every request carries an
id its reply repeats: the owner takes only the reply it waits for.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field

import msgpack
import numpy as np

from ascend_store.backends.base import BackendUnavailable

MAX_FRAME = 64 * 2**20
OPS = ("setup", "ping", "exists", "put", "get", "remove", "close")
_LEN = struct.Struct("<I")


def _empty() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


class ClientReset(BackendUnavailable):
    """The store client is unusable (its setup failed half-way, the service restarted, or the
    binding raised): the owner replaces the helper process that holds it."""


@dataclass
class Request:
    id: int
    op: str  # one of OPS
    keys: list[str] = field(default_factory=list)
    offsets: np.ndarray = field(default_factory=_empty)  # staging offsets (put, get)
    sizes: np.ndarray = field(default_factory=_empty)  # bytes per key (put), the most each may be (get)

    def pack(self) -> bytes:
        return _frame([self.id, self.op, self.keys, _ints(self.offsets), _ints(self.sizes)])

    @classmethod
    def unpack(cls, data: bytes) -> "Request":
        rid, op, keys, offsets, sizes = _unpack(data, 5)
        if op not in OPS or not isinstance(keys, list) or len(offsets) % 8 or len(sizes) % 8:
            raise ValueError(f"malformed request {op!r}")
        return cls(rid, op, keys, np.frombuffer(offsets, dtype="<i8"), np.frombuffer(sizes, dtype="<i8"))


@dataclass
class Reply:
    id: int
    # Per key: exists 1/0/<0, put and remove a return code, get the bytes read.
    values: np.ndarray = field(default_factory=_empty)
    error: str = ""  # the call failed: BackendUnavailable in the owner
    reset: bool = False  # and the client with it (ClientReset)

    def pack(self) -> bytes:
        return _frame([self.id, _ints(self.values), self.error, self.reset])

    @classmethod
    def unpack(cls, data: bytes) -> "Reply":
        rid, values, error, reset = _unpack(data, 4)
        if len(values) % 8 or not isinstance(error, str):
            raise ValueError("malformed reply")
        return cls(rid, np.frombuffer(values, dtype="<i8"), error, bool(reset))


class StoreClient:
    """A store's client as the helper process runs it. Methods raise BackendUnavailable
    when the service cannot serve the call, ClientReset when this client must go."""

    def __init__(self, config: dict, role: str, timeout_s: float):
        raise NotImplementedError

    def set_up(self, addr: int, size: int) -> None:
        """Connect, and register the staging buffer mapped at ``addr`` (``size`` bytes)."""
        raise NotImplementedError

    def exists(self, keys: list[str]) -> list[int]:
        raise NotImplementedError

    def put(self, keys: list[str], addrs: list[int], sizes: list[int]) -> list[int]:
        raise NotImplementedError

    def get(self, keys: list[str], addrs: list[int], sizes: list[int]) -> list[int]:
        """Bytes read per key (``sizes``: the most each may be), 0 for a miss."""
        raise NotImplementedError

    def remove(self, keys: list[str]) -> list[int]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _ints(a) -> bytes:
    return np.asarray(a, dtype="<i8").tobytes()


def _frame(obj) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _unpack(data: bytes, n: int) -> list:
    msg = msgpack.unpackb(data, raw=False, max_bin_len=MAX_FRAME, max_str_len=MAX_FRAME)
    if not isinstance(msg, list) or len(msg) != n or not isinstance(msg[0], int):
        raise ValueError("malformed message")
    return msg


def frame_length(head: bytes) -> int:
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes")
    return n


def recv_blocking(sock: socket.socket) -> bytes | None:
    """One frame's body, or None when the peer closed the socket (the helper's side)."""
    head = _recv_exact(sock, _LEN.size)
    return None if head is None else _recv_exact(sock, frame_length(head))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)
