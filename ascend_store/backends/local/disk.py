"""The local pool's disk tier: one file per object in a private directory, LRU by capacity.

Objects the memory tier evicts are written here (``put``: straight from the arena, one
``pwritev``) and read back into the arena when leased (``read_into``: one ``preadv`` into
the arena, then checked). Tiers are exclusive: a promoted object's file is removed, so an
object lives in exactly one tier and each tier's capacity counts it once.

A file is ``[header][key][payload]``; the header holds the payload length and its CRC32,
and its magic says the payload's form: the object's bytes, or with ``codec="int8"`` the
INT8 form of an object of attention pages (spill_int8.py: about a quarter of fp32 pages, half
of 16-bit ones), decoded back to the object's size on promotion. Either form is read
whatever the pool's current setting.
A file is written under a temporary name and renamed, so a crash leaves either the whole
file or a ``.tmp`` that the next start removes. At start the directory is scanned (the
index is the directory: nothing else to keep consistent): files whose header or length is
wrong are removed, and the LRU order is the files' mtimes. A CRC mismatch or a short read
at promotion makes the object a miss and removes its file. Buffered I/O, not ``O_DIRECT``:
it measured faster on this machine's ext4 (benchmarks/disk_tier.py, docs/benchmarks.md).

One pool per directory: the pool holds an exclusive ``flock`` on ``.lock`` inside it.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
import struct
import zlib
from collections import OrderedDict

from ascend_store.backends.local import spill_int8
from ascend_store.backends.local.pool_config import DISK_CODECS
from ascend_store.common.keys import KEY_RE

log = logging.getLogger("ascend_store.pool")
MAGIC = b"ASDISK01"  # the payload is the object
MAGIC_INT8 = b"ASDISKQ8"  # the payload is the object's INT8 form
_HDR = struct.Struct("<8sQII")  # magic, payload bytes, crc32, key bytes
SUFFIX, TMP = ".obj", ".tmp"


class DiskError(RuntimeError):
    """The disk tier's directory cannot be used."""


def file_name(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + SUFFIX


class DiskTier:
    def __init__(self, directory: str, capacity: int, codec: str = "raw"):
        if codec not in DISK_CODECS:
            raise DiskError(f"disk tier codec {codec!r}: choose one of {', '.join(DISK_CODECS)}")
        self.directory = os.path.abspath(directory)
        self.capacity = capacity
        self.codec = codec
        self._open_dir()
        # key -> (object bytes, file bytes), oldest first
        self._files: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self.used = 0  # bytes of files on disk (headers included)
        self.counters = {"writes": 0, "reads": 0, "evictions": 0, "corrupt": 0, "write_errors": 0,
                         "dropped_at_start": 0, "int8_writes": 0, "object_bytes_written": 0,
                         "file_bytes_written": 0}
        self._scan()

    def _open_dir(self) -> None:
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            st = os.lstat(self.directory)
        except OSError as exc:
            raise DiskError(f"disk tier {self.directory}: {exc.strerror}") from None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise DiskError(f"disk tier {self.directory} must be a directory owned by this user "
                            f"(uid {os.getuid()}) with mode 0700")
        self._lock = os.open(os.path.join(self.directory, ".lock"),
                             os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise DiskError(f"disk tier {self.directory} is used by another running pool") from None

    def _scan(self) -> None:
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(TMP):  # a write cut short by a crash
                os.unlink(entry.path)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            st = entry.stat(follow_symlinks=False)
            key, stored, size = _read_header(entry.path)
            if key is None or file_name(key) != entry.name \
                    or st.st_size != _HDR.size + len(key.encode()) + stored:
                self.counters["dropped_at_start"] += 1
                os.unlink(entry.path)
                continue
            found.append((st.st_mtime_ns, key, size, st.st_size))
        for _, key, size, total in sorted(found):
            self._files[key] = (size, total)
            self.used += total
        if found or self.counters["dropped_at_start"]:
            log.info("disk tier %s: %d objects (%d bytes) kept, %d bad files removed", self.directory,
                     len(self._files), self.used, self.counters["dropped_at_start"])

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, file_name(key))

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def size(self, key: str) -> int:
        """The object's own bytes (what a promotion reserves in memory)."""
        return self._files[key][0]

    def keys(self, prefix: str = "") -> list[tuple[str, int]]:
        return [(k, n) for k, (n, _) in self._files.items() if k.startswith(prefix)]

    def put(self, key: str, obj: memoryview) -> tuple[bool, list[str]]:
        """Store the object ``obj`` under ``key``: (stored, keys evicted from disk to make room)."""
        kb = key.encode()
        form = spill_int8.encode(obj) if self.codec == "int8" else None
        magic, payload = (MAGIC, obj) if form is None else (MAGIC_INT8, form)
        total = _HDR.size + len(kb) + len(payload)
        if total > self.capacity:
            return False, []
        evicted = []
        while self.used + total > self.capacity:
            victim = next(iter(self._files))
            self._drop(victim)
            evicted.append(victim)
            self.counters["evictions"] += 1
        path = self._path(key)
        tmp = path + TMP
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                head = _HDR.pack(magic, len(payload), zlib.crc32(payload), len(kb)) + kb
                if os.writev(fd, [head, payload]) != total:
                    raise OSError(0, "short write")
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError as exc:
            self.counters["write_errors"] += 1
            if self.counters["write_errors"] == 1:
                log.warning("disk tier %s: cannot write (%s); evicted objects are dropped",
                            self.directory, exc.strerror)
            _unlink(tmp)
            return False, evicted
        self._files[key] = (len(obj), total)
        self.used += total
        self.counters["writes"] += 1
        self.counters["int8_writes"] += form is not None
        self.counters["object_bytes_written"] += len(obj)
        self.counters["file_bytes_written"] += len(payload)
        return True, evicted

    def read_into(self, key: str, dest: memoryview) -> bool:
        """Read ``key``'s object into ``dest`` (its exact size), decoding an INT8 form; False
        (and the file removed) when the file is short, corrupt or gone."""
        kb = key.encode()
        stored = self._files[key][1] - _HDR.size - len(kb)
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                head = os.pread(fd, _HDR.size, 0)
                magic = head[:len(MAGIC)]
                buf = dest if magic == MAGIC else bytearray(stored)
                got = os.preadv(fd, [buf], _HDR.size + len(kb))
            finally:
                os.close(fd)
            ok = len(head) == _HDR.size and got == len(buf) == stored
            if ok:
                _, size, crc, klen = _HDR.unpack(head)
                ok = size == stored and klen == len(kb) and zlib.crc32(buf) == crc
            if ok and magic == MAGIC_INT8:
                ok = spill_int8.decode(buf, dest)
            ok = ok and magic in (MAGIC, MAGIC_INT8)
        except OSError:
            ok = False
        if not ok:
            self.counters["corrupt"] += 1
            log.warning("disk tier: object %s is truncated or corrupt; treated as a miss", key)
        self.counters["reads"] += ok
        return ok

    def remove(self, key: str) -> None:
        if key in self._files:
            self._drop(key)

    def _drop(self, key: str) -> None:
        self.used -= self._files.pop(key)[1]
        _unlink(self._path(key))

    def stats(self) -> dict:
        return {"path": self.directory, "capacity": self.capacity, "codec": self.codec,
                "used_bytes": self.used, "objects": len(self._files), **self.counters}

    def close(self) -> None:
        os.close(self._lock)


def _read_header(path: str) -> tuple[str | None, int, int]:
    """A file's key, payload bytes and object bytes; key None for a file that is not ours."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HDR.size)
            if len(head) != _HDR.size:
                return None, 0, 0
            magic, stored, _, klen = _HDR.unpack(head)
            if magic not in (MAGIC, MAGIC_INT8) or klen > 256:
                return None, 0, 0
            key = f.read(klen).decode("ascii", errors="replace")
            size = stored
            if magic == MAGIC_INT8:
                form = f.read(spill_int8.HEAD_BYTES)
                if len(form) != spill_int8.HEAD_BYTES:
                    return None, 0, 0
                size = spill_int8.object_size(form)
    except OSError:
        return None, 0, 0
    return (key, stored, size) if KEY_RE.fullmatch(key) else (None, 0, 0)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
