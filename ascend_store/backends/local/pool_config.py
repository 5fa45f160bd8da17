"""The ``local`` section of ``kv_connector_extra_config``: the embedded pool's settings.

Its capacity is the arena a pool this engine starts reserves in full at once (arena.py):
unless given, a share of the memory free where the arena would live; given, it has to fit
there, which ``check_pool_room`` says before the model loads (plugin.py) instead of the
pool failing to start later, inside the engine, behind a log line.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ascend_store.backends.local.arena import SHM

# The default capacity's share of the room: vLLM's own memory (the KV cache on CPU, the
# weights as they load) and other engines on the host need the rest.
AUTO_SHARE = 0.25
# How the disk tier may store attention pages (disk.py, spill_int8.py).
DISK_CODECS = ("raw", "int8")
MIB, GIB = 2**20, 2**30


def default_socket_path() -> str:
    """``$XDG_RUNTIME_DIR/ascend-store-<uid>/pool.sock``, else the same under the temp dir
    (/tmp): a per-uid directory made 0700, which the client refuses when another user
    created it first (backends/local/trust.py), so a squatter can deny the pool, never
    serve it."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"ascend-store-{os.getuid()}", "pool.sock")


def meminfo(field: str) -> int | None:
    """A ``/proc/meminfo`` figure in bytes (``MemTotal``, ``MemAvailable``), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))
    except (OSError, StopIteration, ValueError):
        return None


def _free(path: str) -> int | None:
    """Free bytes of the file system ``path`` would be on (its nearest existing directory)."""
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def pool_room(socket: str) -> tuple[int, dict[str, int]]:
    """The largest arena a pool at ``socket`` could reserve now, and the readings behind it.

    The pool's server puts its arena in /dev/shm, else beside the socket (server.py); a
    tmpfs (or the page cache) holds it in memory, so each place counts for at most the
    memory available (MemAvailable)."""
    readings = {d: free for d in (SHM, os.path.dirname(socket)) if (free := _free(d)) is not None}
    available = meminfo("MemAvailable")
    rooms = [min(free, available) if available is not None else free for free in readings.values()]
    if available is not None:
        readings["memory available"] = available
    return max(rooms, default=0), readings


def default_capacity(socket: str) -> int:
    return max(MIB, int(pool_room(socket)[0] * AUTO_SHARE) // MIB * MIB)


@dataclass(frozen=True)
class LocalPoolConfig:
    socket: str = field(default_factory=default_socket_path)
    # Arena bytes of a pool this engine starts; 0: AUTO_SHARE of the room when built.
    capacity: int = 0
    # "auto": start a pool inside the engine when none answers at ``socket``;
    # "never": require a standalone pool (requests recompute while it is down).
    start: str = "auto"
    lease_ttl_s: float = 30.0
    # A pool this engine starts serves every engine on the socket until this long after the last.
    idle_exit_s: float = 10.0
    # A uid besides our own that may own the pool's socket, directory and arena (a
    # standalone pool run by a service account); None: only our own.
    trusted_uid: int | None = None
    # The disk tier of a pool this engine starts: objects evicted from memory go to this
    # directory (None: no disk tier), up to ``disk_capacity`` bytes.
    disk_path: str | None = None
    disk_capacity: int = 64 * 2**30
    # How the disk tier stores attention pages: "raw" (as they are) or "int8" (lossy, a
    # quarter of fp32 pages: spill_int8.py).
    disk_codec: str = "raw"

    KEYS = ("socket", "capacity", "start", "lease_ttl_s", "idle_exit_s", "trusted_uid", "disk_path",
            "disk_capacity", "disk_codec")

    def __post_init__(self):
        if self.capacity <= 0:
            object.__setattr__(self, "capacity", default_capacity(self.socket))

    @classmethod
    def parse(cls, raw: Any) -> "LocalPoolConfig":
        from ascend_store.common.config import ConfigError, _Reader, parse_size

        r = _Reader("local", raw)
        socket = r.take("socket", None, str) or default_socket_path()
        capacity = parse_size(r.raw.pop("capacity"), "local.capacity") if "capacity" in r.raw else 0
        disk_capacity = cls.disk_capacity
        if "disk_capacity" in r.raw:
            disk_capacity = parse_size(r.raw.pop("disk_capacity"), "local.disk_capacity")
        disk_path = r.take("disk_path", None, str)
        cfg = cls(socket=os.path.abspath(socket), capacity=capacity,
                  start=r.choice("start", "auto", ("auto", "never")),
                  lease_ttl_s=r.positive("lease_ttl_s", 30.0),
                  idle_exit_s=r.positive("idle_exit_s", 10.0),
                  trusted_uid=r.take("trusted_uid", None, int),
                  disk_path=os.path.abspath(disk_path) if disk_path else None,
                  disk_capacity=disk_capacity,
                  disk_codec=r.choice("disk_codec", "raw", DISK_CODECS))
        if cfg.disk_codec != "raw" and not cfg.disk_path:
            raise ConfigError("local.disk_codec: applies to a disk tier; give local.disk_path too")
        if cfg.trusted_uid is not None and cfg.trusted_uid < 0:
            raise ConfigError(f"local.trusted_uid: must be a uid >= 0, got {cfg.trusted_uid}")
        r.finish(cls.KEYS)
        return cfg


def check_pool_room(cfg: LocalPoolConfig) -> None:
    """Raise ConfigError, naming ``local.capacity``, when a pool this engine would start
    cannot reserve ``cfg.capacity``. Nothing to check with ``start: never`` or while a pool
    answers at the socket: that pool has its own capacity."""
    from ascend_store.backends.local.launcher import ping
    from ascend_store.common.config import ConfigError

    if cfg.start == "never":
        return
    room, readings = pool_room(cfg.socket)
    if cfg.capacity <= room or ping(cfg.socket):
        return
    seen = "; ".join(f"{where}: {n / GIB:.1f} GiB{'' if where == 'memory available' else ' free'}"
                     for where, n in readings.items())
    raise ConfigError(
        f"local.capacity: {cfg.capacity / GIB:.1f} GiB does not fit: the pool this engine starts "
        f"reserves it all at once, and this host has {room / GIB:.1f} GiB for it ({seen}). Give "
        f"a smaller local.capacity, or leave local.capacity out to take {AUTO_SHARE:.0%} of what "
        f"is free ({int(room * AUTO_SHARE) // MIB * MIB / GIB:.1f} GiB now)")
