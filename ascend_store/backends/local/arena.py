"""The pool's arena file: created fully backed, locked while its pool lives, collected after.

An arena is a regular file ``ascend-store-<uid>-<tag>-<epoch>.arena`` in /dev/shm (or
beside the socket). Its pool holds an exclusive ``flock`` on it for its whole life, so anyone can
tell a live arena from one whose pool died without a trace (SIGKILL, OOM kill): its lock
is free. Space is reserved with ``posix_fallocate`` when the arena is made: a tmpfs that
cannot hold it fails the pool's start, instead of an engine's later write to an unbacked
page raising SIGBUS. Files without the ``.arena`` suffix come from versions that held no
lock: they are never collected (a live one could not be told from a dead one).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat

log = logging.getLogger("ascend_store.pool")
PREFIX, SUFFIX = "ascend-store-", ".arena"
SHM = "/dev/shm"


class ArenaError(RuntimeError):
    """The arena cannot be created or backed."""


def name(socket_tag: str, epoch: str) -> str:
    return f"{PREFIX}{os.getuid()}-{socket_tag}-{epoch}{SUFFIX}"


def is_arena(path: str) -> bool:
    base = os.path.basename(path)
    return base.startswith(PREFIX) and base.endswith(SUFFIX)


def create(directory: str, filename: str, size: int) -> tuple[str, int]:
    """Create, lock and back ``directory/filename``; return (path, fd). The pool keeps the
    fd open (it holds the lock) until it removes the arena."""
    path = os.path.join(directory, filename)
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:  # a collector took it between our create and our lock
            same = False
        if same:
            break
        os.close(fd)
    else:
        raise ArenaError(f"could not create the arena {path}: removed while being created")
    try:
        os.posix_fallocate(fd, 0, size)
    except BaseException as exc:  # a signal during a long fallocate must not leak the file
        os.close(fd)
        os.unlink(path)
        if not isinstance(exc, OSError):
            raise
        free = shutil.disk_usage(directory).free
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise ArenaError(f"the pool's arena of {size} bytes does not fit in {directory} ({free} bytes "
                             f"free): {exc.strerror}; lower the capacity or free memory there") from None
        raise ArenaError(f"could not back the arena {path} ({size} bytes): {exc.strerror}") from None
    return path, fd


def remove(path: str, fd: int) -> None:
    """Unlink the arena while still holding its lock, then let go of it."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


def abandoned(path: str) -> bool:
    """Whether no running pool holds the arena at ``path`` (its lock is free, or it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def default_dirs() -> list[str]:
    """Where arenas live unless a pool was told otherwise: /dev/shm, and beside the default
    socket (where a pool puts its arena when /dev/shm is too small)."""
    from ascend_store.common.config import default_socket_path

    return [SHM, os.path.dirname(default_socket_path())]


def gc_arenas(directory: str | None = None) -> list[str]:
    """Remove this user's arenas in ``directory`` (default: ``default_dirs()``) whose pool is
    no longer alive (their lock is free); return the removed paths."""
    removed = []
    uid = os.getuid()
    for d in [directory] if directory else default_dirs():
        try:
            names = [n for n in os.listdir(d) if n.startswith(PREFIX) and n.endswith(SUFFIX)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(d, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its pool is alive
                if os.stat(path, follow_symlinks=False).st_ino == st.st_ino:
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                continue
            finally:
                os.close(fd)
    if removed:
        log.info("removed %d arena(s) of pools no longer running: %s", len(removed), ", ".join(removed))
    return removed
